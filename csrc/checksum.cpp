// CRC-32C (Castagnoli; reflected polynomial 0x82F63B78, as iSCSI and ext4): the checksums a save
// writes of the buckets of state_layout="buffers" (docs/formats.md, "Bucket checksums"). On x86
// with SSE4.2 the CPU's crc32 instruction does the work, in three interleaved lanes (crc32c_hw); elsewhere a
// slicing-by-8 table. Twin: sparse_ckpt/_core_py/checksum.py (same value, errors and messages).
#include "core.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define SCKPT_CRC_HW 1
#endif

namespace sckpt {

namespace {

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;
constexpr Py_ssize_t kReleaseGilBytes = 1 << 20;  // below this, the GIL round trip costs more than it frees

/// ``fn()``, without the GIL where it works on ``bytes`` of at least ``kReleaseGilBytes``.
template <class F>
void unlocked_above(Py_ssize_t bytes, F&& fn) {
    if (bytes >= kReleaseGilBytes) {
        py::gil_scoped_release unlocked;
        fn();
    } else {
        fn();
    }
}

struct Crc32cTables {
    uint32_t t[8][256];
    Crc32cTables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; ++i)
            for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
    }
};

const Crc32cTables& crc_tables() {
    static const Crc32cTables tables;
    return tables;
}

/// The register after ``n`` bytes at ``p`` from register ``reg`` (slicing-by-8).
uint32_t crc32c_table(uint32_t reg, const unsigned char* p, size_t n) {
    const auto& t = crc_tables().t;
    while (n >= 8) {
        uint32_t lo = reg ^ (uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24);
        reg = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^ t[3][p[4]] ^
              t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n--) reg = t[0][(reg ^ *p++) & 0xFFu] ^ (reg >> 8);
    return reg;
}

#ifdef SCKPT_CRC_HW
constexpr size_t kLane = 4096;  // bytes per lane of the three-lane loop (a multiple of 8)

__attribute__((target("sse4.2"))) uint32_t crc32c_hw1(uint32_t reg, const unsigned char* p, size_t n) {
    uint64_t r = reg;
    while (n >= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        r = _mm_crc32_u64(r, v);
        p += 8;
        n -= 8;
    }
    reg = static_cast<uint32_t>(r);
    while (n--) reg = _mm_crc32_u8(reg, *p++);
    return reg;
}

/// The register's shift over kLane zero bytes (the CRC register is linear over GF(2): the register
/// after ``a`` then ``b`` is this shift of the register after ``a``, XOR the register of ``b`` from
/// zero), one table per byte of the register, built from the shifts of its 32 single bits.
struct LaneShift {
    uint32_t t[4][256];
    LaneShift() {
        static const unsigned char zeros[kLane] = {};
        uint32_t bit[32];
        for (int i = 0; i < 32; ++i) bit[i] = crc32c_hw1(1u << i, zeros, kLane);
        for (int k = 0; k < 4; ++k)
            for (uint32_t b = 0; b < 256; ++b) {
                uint32_t x = 0;
                for (int i = 0; i < 8; ++i)
                    if (b & (1u << i)) x ^= bit[8 * k + i];
                t[k][b] = x;
            }
    }
    uint32_t operator()(uint32_t reg) const {
        return t[0][reg & 0xFFu] ^ t[1][(reg >> 8) & 0xFFu] ^ t[2][(reg >> 16) & 0xFFu] ^ t[3][reg >> 24];
    }
};

/// The crc32 instruction has a latency of three cycles and a throughput of one: three independent
/// lanes (kLane bytes apart, each from register zero but the first) keep it busy, and each group of
/// three is joined by two lane shifts. The same register as one lane would give.
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t reg, const unsigned char* p, size_t n) {
    while (n && (reinterpret_cast<uintptr_t>(p) & 7u)) {
        reg = _mm_crc32_u8(reg, *p++);
        --n;
    }
    if (n >= 3 * kLane) {
        static const LaneShift shift;
        while (n >= 3 * kLane) {
            uint64_t a = reg, b = 0, c = 0;
            for (size_t i = 0; i < kLane; i += 8) {
                uint64_t va, vb, vc;
                std::memcpy(&va, p + i, 8);
                std::memcpy(&vb, p + kLane + i, 8);
                std::memcpy(&vc, p + 2 * kLane + i, 8);
                a = _mm_crc32_u64(a, va);
                b = _mm_crc32_u64(b, vb);
                c = _mm_crc32_u64(c, vc);
            }
            reg = shift(shift(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(c);
            p += 3 * kLane;
            n -= 3 * kLane;
        }
    }
    return crc32c_hw1(reg, p, n);
}

bool have_crc_hw() {
    static const bool yes = __builtin_cpu_supports("sse4.2");
    return yes;
}
#endif

uint32_t crc32c_update(uint32_t reg, const unsigned char* p, size_t n) {
#ifdef SCKPT_CRC_HW
    if (have_crc_hw()) return crc32c_hw(reg, p, n);
#endif
    return crc32c_table(reg, p, n);
}

struct Buffer {
    Py_buffer view{};
    bool held = false;
    Buffer() = default;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() {
        if (held) PyBuffer_Release(&view);
    }
};

}  // namespace

namespace {

constexpr size_t kGatherPiece = 32 << 10;  // bytes copied, then checksummed while still in L1

/// ``items[i]`` of the list ``items`` (named ``what``) as an unsigned 64-bit int, or raise (each message
/// after ``prefix``).
uint64_t gather_int(PyObject* items, Py_ssize_t i, const char* what, uint64_t most, const std::string& prefix) {
    PyObject* v = PyList_GET_ITEM(items, i);
    if (!PyLong_CheckExact(v))
        raise_builtin(PyExc_TypeError,
                      Msg() << prefix << "expected " << what << "[" << i << "] as an int, got " << type_name(borrow(v)));
    int overflow = 0;
    long long small = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (small == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow < 0 || (overflow == 0 && small < 0))
        raise_builtin(PyExc_ValueError, Msg() << prefix << what << "[" << i << "] is negative: " << py_repr(borrow(v)));
    unsigned long long out = static_cast<unsigned long long>(small);
    if (overflow > 0) {  // beyond a signed 64-bit int
        out = PyLong_AsUnsignedLongLong(v);
        if (out == static_cast<unsigned long long>(-1) && PyErr_Occurred()) PyErr_Clear();  // (beyond 64 bits)
        else if (out <= most) return out;
        raise_builtin(PyExc_ValueError, Msg() << prefix << what << "[" << i << "] is too large: " << py_repr(borrow(v)));
    }
    if (out > most)
        raise_builtin(PyExc_ValueError, Msg() << prefix << what << "[" << i << "] is too large: " << py_repr(borrow(v)));
    return out;
}

}  // namespace

namespace {

/// One gather checked and ready to run: its sources, in order, and the destination buffer (held).
struct Gather {
    struct Source {
        const unsigned char* p;
        size_t n;
    };
    std::vector<Source> sources;
    Buffer buf;

    /// Copy the sources into the buffer in order; with ``checksum``, the CRC-32C of the buffer (each
    /// piece checksummed while it is in the cache), else 0.
    uint32_t run(bool checksum) const {
        auto* out = static_cast<unsigned char*>(buf.view.buf);
        uint32_t reg = ~0u;
        for (const Source& s : sources) {
            if (!checksum) {
                if (s.n != 0) std::memmove(out, s.p, s.n);  // (an empty source may be at address 0)
                out += s.n;
                continue;
            }
            for (size_t done = 0; done < s.n;) {
                const size_t n = std::min(kGatherPiece, s.n - done);
                std::memmove(out, s.p + done, n);
                reg = crc32c_update(reg, out, n);
                out += n;
                done += n;
            }
        }
        return ~reg;
    }
};

/// ``gather_crc``'s checks of ``(dest, addresses, sizes)``, in its order, each message after ``prefix``;
/// fills ``g`` (its buffer held).
void check_gather(py::handle dest, py::handle addresses, py::handle sizes, const std::string& prefix, Gather& g) {
    PyObject* d = dest.ptr();
    if (!PyByteArray_Check(d) && !PyMemoryView_Check(d))
        raise_builtin(PyExc_TypeError, Msg() << prefix << "expected bytearray or memoryview, got " << type_name(dest));
    if (PyMemoryView_Check(d)) {
        py::object contiguous = steal(PyObject_GetAttrString(d, "c_contiguous"));  // (a released view raises here)
        if (contiguous.ptr() != Py_True)
            raise_builtin(PyExc_ValueError, Msg() << prefix << "expected a C-contiguous buffer");
        if (PyMemoryView_GET_BUFFER(d)->readonly)
            raise_builtin(PyExc_ValueError, Msg() << prefix << "expected a writable buffer");
    }
    if (!PyList_CheckExact(addresses.ptr()))
        raise_builtin(PyExc_TypeError, Msg() << prefix << "expected addresses as a list, got " << type_name(addresses));
    if (!PyList_CheckExact(sizes.ptr()))
        raise_builtin(PyExc_TypeError, Msg() << prefix << "expected sizes as a list, got " << type_name(sizes));
    const Py_ssize_t k = PyList_GET_SIZE(addresses.ptr());
    if (PyList_GET_SIZE(sizes.ptr()) != k)
        raise_builtin(PyExc_ValueError, Msg() << prefix << "addresses and sizes differ in length (" << k << " and "
                                              << PyList_GET_SIZE(sizes.ptr()) << ")");
    g.sources.resize(static_cast<size_t>(k));
    uint64_t total = 0;
    constexpr uint64_t kMostBytes = (uint64_t{1} << 62);
    for (Py_ssize_t i = 0; i < k; ++i) {
        const uint64_t a = gather_int(addresses.ptr(), i, "addresses", ULLONG_MAX, prefix);
        const uint64_t n = gather_int(sizes.ptr(), i, "sizes", kMostBytes, prefix);
        if (n != 0 && a == 0)
            raise_builtin(PyExc_ValueError, Msg() << prefix << "addresses[" << i << "] is 0 for " << n << " bytes");
        total += n;
        if (total > kMostBytes)
            raise_builtin(PyExc_ValueError, Msg() << prefix << "sizes add up to more than " << kMostBytes << " bytes");
        g.sources[static_cast<size_t>(i)] = {reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(a)),
                                             static_cast<size_t>(n)};
    }
    check(PyObject_GetBuffer(d, &g.buf.view, PyBUF_WRITABLE));
    g.buf.held = true;
    if (total != static_cast<uint64_t>(g.buf.view.len))
        raise_builtin(PyExc_ValueError,
                      Msg() << prefix << "sizes add up to " << total << " bytes, the buffer has " << g.buf.view.len);
}

}  // namespace

py::object gather_crc(py::object dest, py::object addresses, py::object sizes) {
    Gather g;
    check_gather(dest, addresses, sizes, "", g);
    uint32_t crc = 0;
    unlocked_above(g.buf.view.len, [&] { crc = g.run(true); });
    return steal(PyLong_FromUnsignedLong(static_cast<unsigned long>(crc)));
}

py::object gather_many(py::object jobs, py::object claims, py::object from_end) {
    if (!PyList_CheckExact(jobs.ptr())) raise_type("jobs as a list", jobs);
    const Py_ssize_t k = PyList_GET_SIZE(jobs.ptr());
    std::vector<std::unique_ptr<Gather>> gathers;
    std::vector<bool> checksums;
    Py_ssize_t total = 0;
    for (Py_ssize_t j = 0; j < k; ++j) {
        py::handle job = PyList_GET_ITEM(jobs.ptr(), j);
        const std::string prefix = "jobs[" + std::to_string(j) + "]: ";
        if (!PyTuple_CheckExact(job.ptr()))
            raise_builtin(PyExc_TypeError, Msg() << prefix << "expected a tuple, got " << type_name(job));
        if (PyTuple_GET_SIZE(job.ptr()) != 4)
            raise_builtin(PyExc_ValueError, Msg() << prefix << "expected (dest, addresses, sizes, checksum), got "
                                                  << PyTuple_GET_SIZE(job.ptr()) << " items");
        PyObject* checksum = PyTuple_GET_ITEM(job.ptr(), 3);
        if (!PyBool_Check(checksum))
            raise_builtin(PyExc_TypeError,
                          Msg() << prefix << "expected checksum as a bool, got " << type_name(borrow(checksum)));
        gathers.push_back(std::make_unique<Gather>());
        check_gather(PyTuple_GET_ITEM(job.ptr(), 0), PyTuple_GET_ITEM(job.ptr(), 1), PyTuple_GET_ITEM(job.ptr(), 2),
                     prefix, *gathers.back());
        checksums.push_back(checksum == Py_True);
        total += gathers.back()->buf.view.len;
    }
    if (!claims.is_none()) {
        if (!PyByteArray_CheckExact(claims.ptr())) raise_type("claims as a bytearray or None", claims);
        if (PyByteArray_GET_SIZE(claims.ptr()) != k)
            raise_builtin(PyExc_ValueError, Msg() << "claims has " << PyByteArray_GET_SIZE(claims.ptr())
                                                  << " bytes for " << k << " jobs");
    }
    if (!PyBool_Check(from_end.ptr())) raise_type("from_end as a bool", from_end);
    const bool backwards = from_end.ptr() == Py_True;
    Buffer claimed;  // (held: the claims cannot be resized while the GIL is released)
    unsigned char* flags = nullptr;
    if (!claims.is_none()) {
        check(PyObject_GetBuffer(claims.ptr(), &claimed.view, PyBUF_WRITABLE));
        claimed.held = true;
        flags = static_cast<unsigned char*>(claimed.view.buf);
    }
    std::vector<uint32_t> crcs(static_cast<size_t>(k), 0);
    std::vector<bool> ran(static_cast<size_t>(k), false);
    auto run = [&] {
        for (size_t n = 0; n < gathers.size(); ++n) {
            const size_t j = backwards ? gathers.size() - 1 - n : n;
            if (flags != nullptr && __atomic_exchange_n(&flags[j], static_cast<unsigned char>(1), __ATOMIC_ACQ_REL) != 0)
                continue;  // claimed by another call
            crcs[j] = gathers[j]->run(checksums[j]);
            ran[j] = true;
        }
    };
    unlocked_above(total, run);
    py::object out = steal(PyList_New(k));
    for (Py_ssize_t j = 0; j < k; ++j) {
        const size_t i = static_cast<size_t>(j);
        py::object v = ran[i] && checksums[i] ? steal(PyLong_FromUnsignedLong(static_cast<unsigned long>(crcs[i])))
                                              : py::none();
        PyList_SET_ITEM(out.ptr(), j, v.release().ptr());
    }
    return out;
}

py::object crc32c(py::object data, py::object value) {
    PyObject* d = data.ptr();
    if (!PyBytes_Check(d) && !PyByteArray_Check(d) && !PyMemoryView_Check(d))
        raise_type("bytes, bytearray or memoryview", data);
    if (PyMemoryView_Check(d)) {
        py::object contiguous = steal(PyObject_GetAttrString(d, "c_contiguous"));  // (a released view raises here)
        if (contiguous.ptr() != Py_True)
            raise_builtin(PyExc_ValueError, steal(PyUnicode_FromString("expected a C-contiguous buffer")));
    }
    if (!PyLong_CheckExact(value.ptr())) raise_type("value as an int", value);
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0 || v < 0 || v > 0xFFFFFFFFLL)
        raise_builtin(PyExc_ValueError, Msg() << "value " << py_repr(value) << " is not a 32-bit CRC (0 to 4294967295)");
    Buffer buf;
    check(PyObject_GetBuffer(d, &buf.view, PyBUF_SIMPLE));
    buf.held = true;
    uint32_t reg = ~static_cast<uint32_t>(v);
    const auto* p = static_cast<const unsigned char*>(buf.view.buf);
    size_t n = static_cast<size_t>(buf.view.len);
    unlocked_above(buf.view.len, [&] { reg = crc32c_update(reg, p, n); });
    return steal(PyLong_FromUnsignedLong(static_cast<unsigned long>(~reg)));
}

}  // namespace sckpt
