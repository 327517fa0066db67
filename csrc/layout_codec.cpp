// encode_layout / plan_scatter: the layout tables of state_layout="buffers" and the scatter plan
// of a load. Twin of sparse_ckpt/_core_py/layout_codec.py. The layout table format is specified in
// docs/formats.md ("Layout codec").
// Every read is bounds-checked and every count checked against the remaining bytes before any
// allocation; element counts are computed in 128 bits, so no input overflows.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core.hpp"

namespace sckpt {

namespace {

constexpr char kLayoutMagic[] = "SCKL";
constexpr int kLayoutVersion = 1;
constexpr size_t kMaxNdim = 64;
constexpr int64_t kI64Max = INT64_MAX;
using Wide = __int128;

/// Decimal text of a 128-bit count (``str(n)`` in the twin's messages).
std::string wide_str(Wide v) {
    if (v == 0) return "0";
    const bool neg = v < 0;
    unsigned __int128 u = neg ? static_cast<unsigned __int128>(-v) : static_cast<unsigned __int128>(v);
    std::string s;
    while (u > 0) {
        s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(u % 10)));
        u /= 10;
    }
    return neg ? "-" + s : s;
}

std::string utf8(py::handle s) {
    Py_ssize_t n = 0;
    const char* raw = PyUnicode_AsUTF8AndSize(s.ptr(), &n);
    if (raw == nullptr) throw py::error_already_set();
    return std::string(raw, static_cast<size_t>(n));
}

/// A dims tuple: the Python object (for messages and outputs) and its values. ``big`` marks a
/// value outside int64 (it fails every chunk check, as the twin's arithmetic does).
struct Dims {
    py::object obj;  // an exact tuple
    std::vector<int64_t> v;
    bool big = false;
};

/// ``_dims(value, what)``: a tuple or list of exact ints, as a tuple.
Dims read_dims(py::handle value, const char* what) {
    PyObject* o = value.ptr();
    std::string expected = std::string(what) + " as a tuple of ints";
    if (!PyTuple_CheckExact(o) && !PyList_CheckExact(o)) raise_type(expected.c_str(), value);
    Dims d;
    d.obj = steal(PySequence_Tuple(o));
    const Py_ssize_t n = PyTuple_GET_SIZE(d.obj.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* x = PyTuple_GET_ITEM(d.obj.ptr(), i);
        if (!PyLong_CheckExact(x)) raise_type(expected.c_str(), x);
    }
    d.v.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        int overflow = 0;
        const long long x = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(d.obj.ptr(), i), &overflow);
        if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
        if (overflow != 0) d.big = true;
        d.v.push_back(overflow > 0 ? kI64Max : overflow < 0 ? INT64_MIN : static_cast<int64_t>(x));
    }
    return d;
}

py::object dims_tuple(const std::vector<int64_t>& v) {
    py::object t = steal(PyTuple_New(static_cast<Py_ssize_t>(v.size())));
    for (size_t i = 0; i < v.size(); ++i) {
        PyTuple_SET_ITEM(t.ptr(), static_cast<Py_ssize_t>(i), steal(PyLong_FromLongLong(v[i])).release().ptr());
    }
    return t;
}

Dims make_dims(std::vector<int64_t> v) {
    Dims d;
    d.obj = dims_tuple(v);
    d.v = std::move(v);
    return d;
}

/// Product of non-negative dims in 128 bits, saturated above int64 (the twin's exact product is
/// only ever compared with 2**63-1 or used below it).
Wide volume(const std::vector<int64_t>& dims) {
    Wide n = 1;
    for (int64_t d : dims) {
        if (d == 0) return 0;
    }
    for (int64_t d : dims) {
        n *= d;
        if (n > static_cast<Wide>(kI64Max)) return static_cast<Wide>(kI64Max) + 1;
    }
    return n;
}

/// ``_check_chunk(where, shape, offsets, sizes)``: the problem's text, or a null object. ``where()``
/// builds the message's prefix, only when there is a problem.
template <class Where>
py::object check_chunk(Where&& where, const Dims& shape, const Dims& offsets, const Dims& sizes) {
    const size_t n = shape.v.size();
    if (!(n == offsets.v.size() && n == sizes.v.size())) {
        return Msg() << where() << ": shape, offsets and sizes have " << static_cast<long long>(n) << ", "
                     << static_cast<long long>(offsets.v.size()) << " and " << static_cast<long long>(sizes.v.size())
                     << " dims";
    }
    if (n > kMaxNdim) {
        return Msg() << where() << ": " << static_cast<long long>(n) << " dims (at most " << static_cast<long long>(kMaxNdim)
                     << ")";
    }
    bool bad = shape.big || offsets.big || sizes.big;
    for (size_t i = 0; i < n && !bad; ++i) {
        const int64_t d = shape.v[i], o = offsets.v[i], s = sizes.v[i];
        bad = d < 0 || o < 0 || s < 0 || static_cast<Wide>(o) + s > d;
    }
    if (bad) {
        return Msg() << where() << ": chunk at offsets " << fmt(offsets.obj) << " of sizes " << fmt(sizes.obj)
                     << " is not inside shape " << fmt(shape.obj);
    }
    if (volume(shape.v) > static_cast<Wide>(kI64Max)) {
        return Msg() << where() << ": shape " << fmt(shape.obj) << " has more than 2**63-1 elements";
    }
    return py::object();
}

/// ``_put_str``: a u32 length and the UTF-8 bytes; unencodable text is a CheckpointFormatError
/// (``where()`` builds its prefix).
template <class Where>
void put_str(std::string& out, py::handle text, Where&& where) {
    Py_ssize_t n = 0;
    const char* raw = PyUnicode_AsUTF8AndSize(text.ptr(), &n);
    if (raw == nullptr) raise_unicode_error(where);
    if (static_cast<uint64_t>(n) > 0xFFFFFFFFull) {
        raise_format_error(Msg() << where() << ": string of " << static_cast<long long>(n)
                                 << " bytes does not fit the layout format");
    }
    put_u32(out, static_cast<uint32_t>(n));
    out.append(raw, static_cast<size_t>(n));
}

py::object where_of(py::handle leaf, py::handle key, py::handle fqn) {
    return Msg() << "leaf " << py_repr(leaf) << ": state " << py_repr(key) << " of " << py_repr(fqn);
}

struct LayoutEntry {
    py::object fqn, key;
    Dims shape, offsets, sizes;
};

struct ReadEntry {
    py::object fqn, key;
    Dims shape, offsets, sizes;
};

/// ``_read_entry``: one bucket entry, checked; ``listed`` holds the (fqn, key) pairs seen (as
/// ``fqn \0 key`` of their UTF-8 bytes: decoded text is always valid UTF-8).
ReadEntry read_entry(Reader& r, std::unordered_set<std::string>& listed) {
    ReadEntry e;
    e.fqn = r.string("FQN");
    e.key = r.string("state key");
    const uint32_t ndim = r.u32("ndim");
    if (ndim > kMaxNdim) {
        r.fail(Msg() << static_cast<unsigned long long>(ndim) << " dims (at most " << static_cast<long long>(kMaxNdim) << ")");
    }
    e.shape = make_dims(r.dims(ndim, "shape"));
    e.offsets = make_dims(r.dims(ndim, "offsets"));
    e.sizes = make_dims(r.dims(ndim, "sizes"));
    auto where = [&] { return Msg() << "state " << py_repr(e.key) << " of " << py_repr(e.fqn); };
    py::object problem = check_chunk(where, e.shape, e.offsets, e.sizes);
    if (problem) r.fail(problem);
    std::string id = utf8(e.fqn);
    id.push_back('\0');
    id += utf8(e.key);
    if (!listed.insert(std::move(id)).second) r.fail(Msg() << where() << " listed twice");
    return e;
}

/// Python's ``_walk``: reads a whole layout table, calling ``on_bucket(bi, dtype, numel)`` as each
/// bucket starts and ``on_entry(bi, dtype, numel, entry, element offset)`` per entry; every check
/// of the format is made as its bytes are read (the callbacks' work comes before later checks).
template <class OnBucket, class OnEntry>
void walk_layout(py::handle data, const py::object& where, OnBucket&& on_bucket, OnEntry&& on_entry) {
    std::string_view bytes(PyBytes_AS_STRING(data.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(data.ptr())));
    Reader r(bytes, where, "layout");
    r.header(std::string_view(kLayoutMagic, 4), kLayoutVersion, "a sparse_ckpt layout table");
    std::unordered_set<std::string> listed;
    const uint32_t n_buckets = r.count("bucket list", 16);
    for (uint32_t bi = 0; bi < n_buckets; ++bi) {
        py::object dtype = r.string("bucket dtype");
        const uint64_t numel = r.u64("bucket numel");
        if (numel > static_cast<uint64_t>(kI64Max)) {
            r.fail(Msg() << "bucket of " << static_cast<unsigned long long>(numel) << " elements (at most 2**63-1)");
        }
        const uint32_t n_entries = r.count("bucket entries", 12);
        on_bucket(bi, dtype, numel);
        Wide offset = 0;
        for (uint32_t k = 0; k < n_entries; ++k) {
            ReadEntry e = read_entry(r, listed);
            const Wide start = offset;
            offset += volume(e.sizes.v);
            if (offset > static_cast<Wide>(numel)) {
                r.fail(Msg() << "chunks hold more than the bucket's " << static_cast<unsigned long long>(numel)
                             << " elements");
            }
            on_entry(bi, dtype, numel, e, start);
        }
        if (offset != static_cast<Wide>(numel)) {
            r.fail(Msg() << "chunks hold " << wide_str(offset) << " elements, the bucket "
                         << static_cast<unsigned long long>(numel));
        }
    }
    if (r.pos() != r.size()) {
        r.fail(Msg() << static_cast<unsigned long long>(r.size() - r.pos()) << " trailing bytes after the layout");
    }
}

struct Chunk {
    bool held = false;
    Dims shape, offsets, sizes;
};

/// ``_chunk(leaf, fqn, value)``: ``chunk_of``'s answer checked.
Chunk read_chunk(py::handle fqn, py::handle value) {
    Chunk c;
    if (value.is_none()) return c;
    if (!PyTuple_CheckExact(value.ptr()) || PyTuple_GET_SIZE(value.ptr()) != 3) {
        std::string what = "chunk_of(" + utf8(py_repr(fqn)) + ") as None or a (shape, offsets, sizes) tuple";
        raise_type(what.c_str(), value);
    }
    c.shape = read_dims(PyTuple_GET_ITEM(value.ptr(), 0), "a parameter shape");
    c.offsets = read_dims(PyTuple_GET_ITEM(value.ptr(), 1), "chunk offsets");
    c.sizes = read_dims(PyTuple_GET_ITEM(value.ptr(), 2), "chunk sizes");
    auto where = [&] { return Msg() << "chunk_of(" << py_repr(fqn) << ")"; };
    py::object problem = check_chunk(where, c.shape, c.offsets, c.sizes);
    if (problem) raise_builtin(PyExc_ValueError, problem);
    c.held = true;
    return c;
}

/// A saved chunk's part in a target: global bounds ``[lo, hi)`` and the saved chunk (for messages).
struct Box {
    std::vector<int64_t> lo, hi;
    py::object offsets, sizes;
};

struct Target {
    py::object fqn, key, dtype;
    Dims shape;
    const Chunk* chunk;
    std::set<std::pair<std::vector<int64_t>, std::vector<int64_t>>> seen;
    Wide covered = 0;
    std::vector<Box> boxes;
};

/// ``_first_overlap``: the first two boxes sharing an element in a sweep along dim 0 (boxes
/// stably sorted by their lower bound there); ``{-1, -1}`` when none do. A 0-d target has at most one
/// box (replicas are used once), so every list of two has dims.
std::pair<long, long> first_overlap(const std::vector<Box>& boxes) {
    if (boxes.size() < 2) return {-1, -1};
    std::vector<size_t> order(boxes.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return boxes[a].lo[0] < boxes[b].lo[0]; });
    for (size_t n = 0; n < order.size(); ++n) {
        const Box& a = boxes[order[n]];
        for (size_t m = n + 1; m < order.size(); ++m) {
            const Box& b = boxes[order[m]];
            if (b.lo[0] >= a.hi[0]) break;
            bool all = true;
            for (size_t d = 0; d < a.lo.size() && all; ++d) all = a.lo[d] < b.hi[d] && b.lo[d] < a.hi[d];
            if (all) return {static_cast<long>(order[n]), static_cast<long>(order[m])};
        }
    }
    return {-1, -1};
}

}  // namespace

py::tuple encode_layout(py::object leaf, py::object entries, py::object bucket_bytes) {
    if (!PyUnicode_CheckExact(leaf.ptr())) raise_type("the leaf as a str", leaf);
    Wide limit = 0;
    bool limit_ok = PyLong_CheckExact(bucket_bytes.ptr());
    if (limit_ok) {
        int overflow = 0;
        const long long b = PyLong_AsLongLongAndOverflow(bucket_bytes.ptr(), &overflow);
        if (b == -1 && PyErr_Occurred()) throw py::error_already_set();
        limit = overflow > 0 ? static_cast<Wide>(1) << 100 : overflow < 0 ? 0 : static_cast<Wide>(b);
        limit_ok = limit >= 1;
    }
    if (!limit_ok) raise_builtin(PyExc_ValueError, Msg() << "bucket_bytes must be a positive int, got " << py_repr(bucket_bytes));
    if (!PyList_CheckExact(entries.ptr()) && !PyTuple_CheckExact(entries.ptr())) raise_type("entries as a list", entries);

    std::vector<LayoutEntry> parsed;
    std::vector<py::object> dtype_order;  // dtypes in order of first appearance
    std::vector<std::vector<std::pair<size_t, Wide>>> by_dtype;  // per dtype: (entry, nbytes)
    py::object dtype_index = steal(PyDict_New());  // dtype str -> index (Python str keys: any text)
    py::object seen = steal(PySet_New(nullptr));    // (fqn, key)
    iterate(entries, [&](py::handle e) {
        if (!PyTuple_CheckExact(e.ptr()) || PyTuple_GET_SIZE(e.ptr()) != 7) raise_type("an entry as a tuple of 7", e);
        PyObject* t = e.ptr();
        py::object fqn = borrow(PyTuple_GET_ITEM(t, 0)), key = borrow(PyTuple_GET_ITEM(t, 1));
        py::object dtype = borrow(PyTuple_GET_ITEM(t, 2)), itemsize = borrow(PyTuple_GET_ITEM(t, 3));
        if (!PyUnicode_CheckExact(fqn.ptr())) raise_type("the entry's fqn as a str", fqn);
        if (!PyUnicode_CheckExact(key.ptr())) raise_type("the entry's key as a str", key);
        if (!PyUnicode_CheckExact(dtype.ptr())) raise_type("the entry's dtype as a str", dtype);
        if (!PyLong_CheckExact(itemsize.ptr())) raise_type("the entry's item size as an int", itemsize);
        LayoutEntry le{fqn, key, read_dims(PyTuple_GET_ITEM(t, 4), "a shape"),
                       read_dims(PyTuple_GET_ITEM(t, 5), "offsets"), read_dims(PyTuple_GET_ITEM(t, 6), "sizes")};
        auto where = [&] { return where_of(leaf, key, fqn); };
        int overflow = 0;
        const long long size = PyLong_AsLongLongAndOverflow(itemsize.ptr(), &overflow);
        if (size == -1 && PyErr_Occurred()) throw py::error_already_set();
        if (overflow != 0 || size < 1 || size > kMaxItemsize) {
            raise_format_error(Msg() << where() << ": item size " << fmt(itemsize) << " (1 to " << kMaxItemsize << ")");
        }
        py::object problem = check_chunk(where, le.shape, le.offsets, le.sizes);
        if (problem) raise_format_error(problem);
        py::object id = py::make_tuple(fqn, key);
        const int dup = PySet_Contains(seen.ptr(), id.ptr());
        check(dup);
        if (dup) raise_format_error(Msg() << where() << ": listed twice in one layout");
        check(PySet_Add(seen.ptr(), id.ptr()));
        py::object index = dict_get(dtype_index, dtype);
        size_t di;
        if (index.is_none()) {
            di = dtype_order.size();
            dtype_order.push_back(dtype);
            by_dtype.emplace_back();
            py::object n = steal(PyLong_FromSize_t(di));
            check(PyDict_SetItem(dtype_index.ptr(), dtype.ptr(), n.ptr()));
        } else {
            di = PyLong_AsSize_t(index.ptr());
        }
        by_dtype[di].emplace_back(parsed.size(), volume(le.sizes.v) * size);
        parsed.push_back(std::move(le));
    });

    struct Bucket {
        py::object dtype;
        Wide numel = 0;
        std::vector<std::pair<size_t, Wide>> members;  // (entry, element offset)
    };
    std::vector<Bucket> buckets;
    for (size_t di = 0; di < dtype_order.size(); ++di) {
        const py::object& dtype = dtype_order[di];
        Bucket current{dtype, 0, {}};
        Wide nbytes = 0;
        for (const auto& [i, size] : by_dtype[di]) {
            if (!current.members.empty() && nbytes + size > limit) {
                buckets.push_back(std::move(current));
                current = Bucket{dtype, 0, {}};
                nbytes = 0;
            }
            current.members.emplace_back(i, current.numel);
            current.numel += volume(parsed[i].sizes.v);
            nbytes += size;
            if (current.numel > static_cast<Wide>(kI64Max)) {
                raise_format_error(Msg() << where_of(leaf, parsed[i].key, parsed[i].fqn) << ": its " << fmt(dtype)
                                         << " bucket would hold " << wide_str(current.numel)
                                         << " elements (at most 2**63-1)");
            }
        }
        if (!current.members.empty()) buckets.push_back(std::move(current));
    }

    std::string out(kLayoutMagic, 4);
    put_u16(out, static_cast<uint16_t>(kLayoutVersion));
    put_len_u32(out, static_cast<Py_ssize_t>(buckets.size()));
    py::object result = steal(PyList_New(0));
    auto dtype_where = [&] { return Msg() << "leaf " << py_repr(leaf) << ": layout dtype"; };
    for (const Bucket& b : buckets) {
        put_str(out, b.dtype, dtype_where);
        put_u64(out, static_cast<uint64_t>(b.numel));
        put_len_u32(out, static_cast<Py_ssize_t>(b.members.size()));
        py::object members = steal(PyList_New(0));
        for (const auto& [i, offset] : b.members) {
            const LayoutEntry& e = parsed[i];
            auto where = [&] { return where_of(leaf, e.key, e.fqn); };
            put_str(out, e.fqn, where);
            put_str(out, e.key, where);
            put_u32(out, static_cast<uint32_t>(e.shape.v.size()));
            for (const Dims* d : {&e.shape, &e.offsets, &e.sizes}) {
                for (int64_t x : d->v) put_i64(out, x);
            }
            py::object pair = py::make_tuple(static_cast<Py_ssize_t>(i), static_cast<long long>(offset));
            check(PyList_Append(members.ptr(), pair.ptr()));
        }
        py::object entry = py::make_tuple(b.dtype, static_cast<long long>(b.numel), members);
        check(PyList_Append(result.ptr(), entry.ptr()));
    }
    return py::make_tuple(py::bytes(out), result);
}

py::object decode_layout(py::object leaf, py::object data) {
    if (!PyUnicode_CheckExact(leaf.ptr())) raise_type("the leaf as a str", leaf);
    if (!PyBytes_CheckExact(data.ptr())) raise_type("a layout table as bytes", data);
    py::object out = steal(PyList_New(0));
    py::object entries;
    walk_layout(
        data, Msg() << "leaf " << py_repr(leaf) << " layout table",
        [&](uint32_t, const py::object& dtype, uint64_t numel) {
            entries = steal(PyList_New(0));
            py::object b = py::make_tuple(dtype, steal(PyLong_FromUnsignedLongLong(numel)), entries);
            check(PyList_Append(out.ptr(), b.ptr()));
        },
        [&](uint32_t, const py::object&, uint64_t, const ReadEntry& e, Wide) {
            py::object t = py::make_tuple(e.fqn, e.key, e.shape.obj, e.offsets.obj, e.sizes.obj);
            check(PyList_Append(entries.ptr(), t.ptr()));
        });
    return out;
}

py::tuple plan_scatter(py::object leaf, py::object layouts, py::object chunk_of) {
    if (!PyUnicode_CheckExact(leaf.ptr())) raise_type("the leaf as a str", leaf);
    if (!PyList_CheckExact(layouts.ptr()) && !PyTuple_CheckExact(layouts.ptr())) raise_type("layouts as a list", layouts);
    std::unordered_map<std::string, Chunk> chunks;  // node-based: Chunk addresses stay valid
    std::vector<Target> targets;
    std::map<std::pair<std::string, std::string>, size_t> target_of;
    py::object sources = steal(PyList_New(0));
    std::map<std::pair<size_t, size_t>, size_t> source_of;
    py::object ops = steal(PyList_New(0));
    size_t li = 0;
    iterate(layouts, [&](py::handle data) {
        if (!PyBytes_CheckExact(data.ptr())) raise_type("a layout table as bytes", data);
        py::object where = Msg() << "leaf " << py_repr(leaf) << " layout table " << static_cast<unsigned long long>(li);
        walk_layout(data, where, [](uint32_t, const py::object&, uint64_t) {},
                    [&](uint32_t bi, const py::object& dtype, uint64_t numel, const ReadEntry& e, Wide start) {
                const py::object& fqn = e.fqn;
                const py::object& key = e.key;
                const Dims& shape = e.shape;
                const Dims& offsets = e.offsets;
                const Dims& sizes = e.sizes;
                std::pair<std::string, std::string> id{utf8(fqn), utf8(key)};
                auto cf = chunks.find(id.first);
                if (cf == chunks.end()) {
                    py::object answer = steal(PyObject_CallOneArg(chunk_of.ptr(), fqn.ptr()));
                    cf = chunks.emplace(id.first, read_chunk(fqn, answer)).first;
                }
                const Chunk& mine = cf->second;
                if (!mine.held) return;
                size_t ti;
                auto tf = target_of.find(id);
                if (tf == target_of.end()) {
                    if (mine.shape.v != shape.v || mine.shape.big) {
                        raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << ": state " << py_repr(key) << " of "
                                                   << py_repr(fqn) << " has shape " << fmt(shape.obj)
                                                   << " in the checkpoint, the parameter " << fmt(mine.shape.obj));
                    }
                    ti = targets.size();
                    target_of.emplace(id, ti);
                    targets.push_back(Target{fqn, key, dtype, shape, &mine, {}, 0, {}});
                } else {
                    ti = tf->second;
                    const Target& first = targets[ti];
                    const int same_dtype = PyObject_RichCompareBool(first.dtype.ptr(), dtype.ptr(), Py_EQ);
                    check(same_dtype);
                    if (!same_dtype || first.shape.v != shape.v) {
                        raise_format_error(Msg() << "leaf " << py_repr(leaf) << ": layout tables disagree on state "
                                                 << py_repr(key) << " of " << py_repr(fqn) << " (" << fmt(first.dtype)
                                                 << " " << fmt(first.shape.obj) << " and " << fmt(dtype) << " "
                                                 << fmt(shape.obj) << ")");
                    }
                }
                Target& t = targets[ti];
                if (!t.seen.emplace(offsets.v, sizes.v).second) return;
                const size_t n = shape.v.size();
                std::vector<int64_t> lo(n), hi(n), box(n), src_start(n), dst_start(n);
                bool empty = false;
                for (size_t i = 0; i < n; ++i) {
                    lo[i] = std::max(offsets.v[i], mine.offsets.v[i]);
                    hi[i] = std::min(offsets.v[i] + sizes.v[i], mine.offsets.v[i] + mine.sizes.v[i]);
                    box[i] = hi[i] - lo[i];
                    if (box[i] <= 0) empty = true;
                    src_start[i] = lo[i] - offsets.v[i];
                    dst_start[i] = lo[i] - mine.offsets.v[i];
                }
                if (empty) return;
                auto sf = source_of.find({li, bi});
                size_t si;
                if (sf == source_of.end()) {
                    si = source_of.size();
                    source_of.emplace(std::make_pair(li, static_cast<size_t>(bi)), si);
                    py::object src = py::make_tuple(static_cast<Py_ssize_t>(li), static_cast<Py_ssize_t>(bi), dtype,
                                                    steal(PyLong_FromUnsignedLongLong(numel)));
                    check(PyList_Append(sources.ptr(), src.ptr()));
                } else {
                    si = sf->second;
                }
                py::object op = py::make_tuple(static_cast<Py_ssize_t>(si), static_cast<long long>(start), sizes.obj,
                                               dims_tuple(src_start), static_cast<Py_ssize_t>(ti), dims_tuple(dst_start),
                                               dims_tuple(box));
                check(PyList_Append(ops.ptr(), op.ptr()));
                t.covered += volume(box);
                t.boxes.push_back(Box{std::move(lo), std::move(hi), offsets.obj, sizes.obj});
            });
        ++li;
    });
    py::object out_targets = steal(PyList_New(0));
    for (const Target& t : targets) {
        const auto [a, b] = first_overlap(t.boxes);
        if (a >= 0) {
            const Box& x = t.boxes[static_cast<size_t>(a)];
            const Box& y = t.boxes[static_cast<size_t>(b)];
            raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << ": state " << py_repr(t.key) << " of "
                                       << py_repr(t.fqn) << ": the checkpoint's layouts overlap (chunks at offsets "
                                       << fmt(x.offsets) << " of sizes " << fmt(x.sizes) << " and at offsets "
                                       << fmt(y.offsets) << " of sizes " << fmt(y.sizes)
                                       << "): a damaged or edited checkpoint");
        }
        const Wide need = volume(t.chunk->sizes.v);
        if (t.covered != need) {
            raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << ": state " << py_repr(t.key) << " of "
                                       << py_repr(t.fqn) << ": the checkpoint's buffers cover " << wide_str(t.covered)
                                       << " of the " << wide_str(need)
                                       << " elements of this rank's chunk (a buffer or layout table is missing from the "
                                          "checkpoint)");
        }
        py::object tup = py::make_tuple(t.fqn, t.key, t.dtype, t.shape.obj, t.chunk->offsets.obj, t.chunk->sizes.obj);
        check(PyList_Append(out_targets.ptr(), tup.ptr()));
    }
    return py::make_tuple(out_targets, sources, ops);
}

}  // namespace sckpt
