// encode_layout / plan_scatter: the layout tables of state_layout="buffers" and the scatter plan
// of a load. Twin of sparse_ckpt/_core_py/layout_codec.py. The layout table format is specified in
// docs/formats.md ("Layout codec").
// Every read is bounds-checked and every count checked against the remaining bytes before any
// allocation; element counts are computed in 128 bits, so no input overflows.
#include <algorithm>
#include <array>
#include <functional>
#include <string>
#include <string_view>
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

/// ``t``, a new tuple of exact ints, strs and such tuples only, untracked by the cycle collector:
/// it can be part of no cycle, and the collector untracks such a tuple at its first pass anyway
/// (a plan holds tens of thousands; tracked, each would be scanned by that pass first).
py::object atomic(py::object t) {
    PyObject_GC_UnTrack(t.ptr());
    return t;
}

/// The tuple of ``n`` values at ``v``.
py::object dims_tuple(const int64_t* v, size_t n) {
    py::object t = steal(PyTuple_New(static_cast<Py_ssize_t>(n)));
    for (size_t i = 0; i < n; ++i) {
        PyTuple_SET_ITEM(t.ptr(), static_cast<Py_ssize_t>(i), steal(PyLong_FromLongLong(v[i])).release().ptr());
    }
    return atomic(std::move(t));
}

py::object dims_tuple(const std::vector<int64_t>& v) { return dims_tuple(v.data(), v.size()); }

Dims make_dims(std::vector<int64_t> v) {
    Dims d;
    d.obj = dims_tuple(v);
    d.v = std::move(v);
    return d;
}

/// Product of non-negative dims in 128 bits, saturated above int64 (the twin's exact product is
/// only ever compared with 2**63-1 or used below it).
Wide volume(const int64_t* dims, size_t count) {
    Wide n = 1;
    for (size_t i = 0; i < count; ++i) {
        if (dims[i] == 0) return 0;
    }
    for (size_t i = 0; i < count; ++i) {
        n *= dims[i];
        if (n > static_cast<Wide>(kI64Max)) return static_cast<Wide>(kI64Max) + 1;
    }
    return n;
}

Wide volume(const std::vector<int64_t>& dims) { return volume(dims.data(), dims.size()); }

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

constexpr size_t kNone = static_cast<size_t>(-1);

/// A layout entry as read: its FQN and key as views of the table's UTF-8 bytes and its dims as
/// values (the table's bytes stay alive while the entry is used; nothing is allocated per entry).
struct RawEntry {
    std::string_view fqn, key;
    size_t hash_fqn = 0;
    size_t listing = 0;  // its (FQN, key) in the Listings
    size_t n = 0;
    const char* raw = nullptr;  // the 3n little-endian int64 values: shape, offsets, sizes
    int64_t v[3 * kMaxNdim];    // the same values; the first 3n are set

    const int64_t* shape() const { return v; }
    const int64_t* offsets() const { return v + n; }
    const int64_t* sizes() const { return v + 2 * n; }
    std::string_view shape_bytes() const { return {raw, 8 * n}; }
    const char* placement() const { return raw + 8 * n; }  // offsets and sizes: 2n values
    std::string_view sizes_bytes() const { return {raw + 16 * n, 8 * n}; }
    py::object fqn_str() const { return str_of(fqn); }
    py::object key_str() const { return str_of(key); }
    static py::object str_of(std::string_view s) {
        return steal(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "strict"));
    }
};

size_t hash_bytes(std::string_view s) { return std::hash<std::string_view>{}(s); }

size_t hash_pair(size_t a, size_t b) { return a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2)); }

/// Items kept once each, like a dict's keys: ``find(hash, x)`` is the index of the item that is
/// ``same`` as ``x`` (``kNone`` when none is), ``add(hash, x)`` appends one that is not there. Open
/// addressing with linear probing; a slot holds an item's hash and index + 1 (an item is read only
/// when its hash is the one looked for).
template <class Item>
class Interner {
public:
    size_t find(size_t hash, const Item& x) const {
        if (slots_.empty()) return kNone;
        const Slot& slot = slots_[probe(hash, x)];
        return slot.index == 0 ? kNone : slot.index - 1;
    }
    size_t add(size_t hash, Item x) {
        if ((items_.size() + 1) * 2 > slots_.size()) grow();
        const size_t at = probe(hash, x);
        items_.push_back(std::move(x));
        slots_[at] = Slot{hash, items_.size()};
        return items_.size() - 1;
    }
    Item& operator[](size_t i) { return items_[i]; }
    const Item& operator[](size_t i) const { return items_[i]; }

private:
    struct Slot {
        size_t hash = 0;
        size_t index = 0;  // the item's index + 1; 0: empty
    };

    static size_t mix(size_t h) { return h ^ (h >> 29); }

    size_t probe(size_t hash, const Item& x) const {
        const size_t mask = slots_.size() - 1;
        size_t i = mix(hash) & mask;
        while (slots_[i].index != 0 && !(slots_[i].hash == hash && items_[slots_[i].index - 1].same(x))) i = (i + 1) & mask;
        return i;
    }

    void grow() {
        std::vector<Slot> old(std::max<size_t>(16, slots_.size() * 2));
        old.swap(slots_);
        const size_t mask = slots_.size() - 1;
        for (const Slot& s : old) {
            if (s.index == 0) continue;
            size_t i = mix(s.hash) & mask;
            while (slots_[i].index != 0) i = (i + 1) & mask;
            slots_[i] = s;
        }
    }

    std::vector<Item> items_;
    std::vector<Slot> slots_;
};

/// An (FQN, key) pair met in the tables (decoded text is valid UTF-8, so equal bytes are equal
/// strs): the table that last listed it, and (plan_scatter) its parameter and target.
struct Listing {
    std::string_view fqn, key;
    size_t table = 0;
    size_t param = kNone, target = kNone;
    bool same(const Listing& o) const { return fqn == o.fqn && key == o.key; }
};
using Listings = Interner<Listing>;

/// ``_check_chunk`` of a table entry: its problem's text (as ``check_chunk`` words it), or a null
/// object. ``where()`` builds the message's prefix, only when there is a problem.
template <class Where>
py::object check_entry(Where&& where, const RawEntry& e) {
    // A table's dims are int64 values, as many of each as ndim (at most kMaxNdim): only the bounds
    // and the volume can be wrong. Every problem is worded by check_chunk.
    bool bad = false;
    for (size_t i = 0; i < e.n && !bad; ++i) {
        const int64_t d = e.shape()[i], o = e.offsets()[i], s = e.sizes()[i];
        bad = d < 0 || o < 0 || s < 0 || static_cast<Wide>(o) + s > d;
    }
    if (!bad && volume(e.shape(), e.n) <= static_cast<Wide>(kI64Max)) return py::object();
    const Dims shape = make_dims(std::vector<int64_t>(e.shape(), e.shape() + e.n));
    const Dims offsets = make_dims(std::vector<int64_t>(e.offsets(), e.offsets() + e.n));
    const Dims sizes = make_dims(std::vector<int64_t>(e.sizes(), e.sizes() + e.n));
    return check_chunk(where, shape, offsets, sizes);
}

/// ``_read_entry``: one bucket entry of table ``table`` into ``e``, checked; ``listed`` holds
/// the (FQN, key) pairs seen, each with the last table that listed it.
void read_entry(Reader& r, Listings& listed, size_t table, RawEntry& e) {
    e.fqn = r.utf8("FQN");
    e.key = r.utf8("state key");
    const uint32_t ndim = r.u32("ndim");
    if (ndim > kMaxNdim) {
        r.fail(Msg() << static_cast<unsigned long long>(ndim) << " dims (at most " << static_cast<long long>(kMaxNdim) << ")");
    }
    e.n = ndim;
    e.raw = r.take(0, "shape");
    size_t k = 0;
    for (const char* what : {"shape", "offsets", "sizes"}) {
        for (uint32_t i = 0; i < ndim; ++i) e.v[k++] = static_cast<int64_t>(get_le(r.take(8, what), 8));
    }
    auto where = [&] { return Msg() << "state " << py_repr(e.key_str()) << " of " << py_repr(e.fqn_str()); };
    py::object problem = check_entry(where, e);
    if (problem) r.fail(problem);
    e.hash_fqn = hash_bytes(e.fqn);
    const size_t hash = hash_pair(e.hash_fqn, hash_bytes(e.key));
    Listing id{e.fqn, e.key, table};
    e.listing = listed.find(hash, id);
    if (e.listing == kNone) {
        e.listing = listed.add(hash, id);
    } else if (listed[e.listing].table == table) {
        r.fail(Msg() << where() << " listed twice");
    } else {
        listed[e.listing].table = table;
    }
}

/// Python's ``_walk``: reads a whole layout table (number ``table`` of those ``listed`` has seen),
/// calling ``on_bucket(bi, dtype, numel)`` as each bucket starts and ``on_entry(bi, dtype, numel,
/// entry, element offset)`` per entry; every check of the format is made as its bytes are read (the
/// callbacks' work comes before later checks). The entry's views point into ``data``, which the
/// caller keeps alive while ``listed`` is used.
template <class OnBucket, class OnEntry>
void walk_layout(py::handle data, const py::object& where, Listings& listed, size_t table, OnBucket&& on_bucket,
                 OnEntry&& on_entry) {
    std::string_view bytes(PyBytes_AS_STRING(data.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(data.ptr())));
    Reader r(bytes, where, "layout");
    r.header(std::string_view(kLayoutMagic, 4), kLayoutVersion, "a sparse_ckpt layout table");
    RawEntry e;
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
            read_entry(r, listed, table, e);
            const Wide start = offset;
            offset += volume(e.sizes(), e.n);
            if (offset > static_cast<Wide>(numel)) {
                r.fail(Msg() << "chunks hold more than the bucket's " << static_cast<unsigned long long>(numel)
                             << " elements");
            }
            on_entry(bi, dtype, numel, static_cast<const RawEntry&>(e), start);
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

/// A parameter met in the tables: its FQN (the str ``chunk_of`` was called with) and its chunk.
struct Param {
    std::string_view name;  // the FQN's bytes
    py::object fqn;
    Chunk chunk;
    bool same(const Param& o) const { return name == o.name; }
};

/// A target's placements and boxes past its first two (most targets have one or two).
struct TargetMore {
    std::vector<const char*> seen, boxes;
    std::unordered_set<std::string_view> seen_set;  // all placements, once there are many
};

/// A (FQN, key) this rank needs. Placements (a saved chunk's offsets and sizes) are pointers to
/// 2n int64 values in a table's bytes; ``seen`` are those met (the twin's set), ``boxes`` those
/// with a part in this rank's chunk.
struct Target {
    py::object out;    // (fqn, key, dtype, shape, offsets, sizes): the plan's target
    py::object index;  // the target's number
    const char* shape_raw = nullptr;            // n int64 values
    size_t n = 0, param = 0;
    Wide covered = 0;
    std::array<const char*, 2> seen{}, boxes{};
    size_t n_seen = 0, n_boxes = 0;
    size_t more = kNone;  // its TargetMore, once it has one

    PyObject* item(Py_ssize_t i) const { return PyTuple_GET_ITEM(out.ptr(), i); }
    bool same_shape(std::string_view shape_bytes) const {
        return shape_bytes.size() == 8 * n && std::memcmp(shape_raw, shape_bytes.data(), 8 * n) == 0;
    }
    const char* box(size_t i, const std::vector<TargetMore>& mores) const {
        return i < boxes.size() ? boxes[i] : mores[more].boxes[i - boxes.size()];
    }
};

/// Records placement ``p`` as met for ``t``; whether it was new (replicas are used once).
bool add_seen(Target& t, const char* p, std::vector<TargetMore>& mores) {
    constexpr size_t kListMax = 8;  // past this many, a hash set
    const size_t bytes = 16 * t.n;
    auto met = [&](const char* q) { return std::memcmp(q, p, bytes) == 0; };
    for (size_t i = 0; i < std::min(t.n_seen, t.seen.size()); ++i) {
        if (met(t.seen[i])) return false;
    }
    if (t.n_seen < t.seen.size()) {
        t.seen[t.n_seen++] = p;
        return true;
    }
    if (t.more == kNone) {
        t.more = mores.size();
        mores.emplace_back();
    }
    TargetMore& m = mores[t.more];
    if (m.seen_set.empty()) {
        for (const char* q : m.seen) {
            if (met(q)) return false;
        }
        m.seen.push_back(p);
        if (m.seen.size() > kListMax) {
            for (const char* q : t.seen) m.seen_set.emplace(q, bytes);
            for (const char* q : m.seen) m.seen_set.emplace(q, bytes);
        }
    } else if (!m.seen_set.emplace(p, bytes).second) {
        return false;
    }
    ++t.n_seen;
    return true;
}

void add_box(Target& t, const char* p, std::vector<TargetMore>& mores) {
    if (t.n_boxes < t.boxes.size()) {
        t.boxes[t.n_boxes++] = p;
        return;
    }
    if (t.more == kNone) {
        t.more = mores.size();
        mores.emplace_back();
    }
    mores[t.more].boxes.push_back(p);
    ++t.n_boxes;
}

/// The global bounds ``[lo, hi)`` of a placed chunk's part in ``mine``: ``2n`` values at ``out``.
void bounds(const char* placed, size_t n, const Chunk& mine, int64_t* out) {
    for (size_t d = 0; d < n; ++d) {
        const int64_t o = static_cast<int64_t>(get_le(placed + 8 * d, 8));
        const int64_t s = static_cast<int64_t>(get_le(placed + 8 * (n + d), 8));
        out[d] = std::max(o, mine.offsets.v[d]);
        out[n + d] = std::min(o + s, mine.offsets.v[d] + mine.sizes.v[d]);
    }
}

/// ``_first_overlap``: the first two boxes sharing an element in a sweep along dim 0 (boxes
/// stably sorted by their lower bound there); ``{-1, -1}`` when none do. A 0-d target has at most one
/// box (replicas are used once), so every list of two has dims.
std::pair<long, long> first_overlap(const Target& t, const Chunk& mine, const std::vector<TargetMore>& mores) {
    const size_t count = t.n_boxes, n = t.n;
    if (count < 2 || n == 0) return {-1, -1};
    std::vector<int64_t> lohi(count * 2 * n);  // per box: lo then hi
    for (size_t i = 0; i < count; ++i) bounds(t.box(i, mores), n, mine, &lohi[i * 2 * n]);
    auto lo = [&](size_t i) { return &lohi[i * 2 * n]; };
    auto hi = [&](size_t i) { return &lohi[i * 2 * n + n]; };
    std::vector<size_t> order(count);
    for (size_t i = 0; i < count; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return lo(a)[0] < lo(b)[0]; });
    for (size_t a = 0; a < count; ++a) {
        const size_t i = order[a];
        for (size_t b = a + 1; b < count; ++b) {
            const size_t j = order[b];
            if (lo(j)[0] >= hi(i)[0]) break;
            bool all = true;
            for (size_t d = 0; d < n && all; ++d) all = lo(i)[d] < hi(j)[d] && lo(j)[d] < hi(i)[d];
            if (all) return {static_cast<long>(i), static_cast<long>(j)};
        }
    }
    return {-1, -1};
}

/// A tuple of the given exact ints, strs and tuples of those (new references taken), untracked as
/// ``atomic`` says.
py::object tuple_of(std::initializer_list<PyObject*> items) {
    py::object t = steal(PyTuple_New(static_cast<Py_ssize_t>(items.size())));
    Py_ssize_t i = 0;
    for (PyObject* item : items) PyTuple_SET_ITEM(t.ptr(), i++, borrow(item).release().ptr());
    return atomic(std::move(t));
}

/// Objects made from table bytes, shared: equal bytes give the same object (strs and tuples are
/// immutable, so sharing one is equal to making another). Keeps the last few.
class SharedObjects {
public:
    template <class Make>
    py::object get(std::string_view bytes, Make&& make) {
        for (const Item& item : items_) {
            if (item.obj && item.bytes == bytes) return item.obj;
        }
        Item& slot = items_[next_++ % items_.size()];
        slot = Item{bytes, make()};
        return slot.obj;
    }

private:
    struct Item {
        std::string_view bytes;
        py::object obj;
    };
    std::array<Item, 4> items_;
    size_t next_ = 0;
};

/// ``hash(s)`` of an exact str (cached in the str: a str's hash never fails or is -1).
size_t str_hash(PyObject* s) {
    const Py_hash_t h = PyObject_Hash(s);
    if (h == -1) throw py::error_already_set();
    return static_cast<size_t>(h);
}

/// ``a == b`` of two exact strs (any text, lone surrogates too).
bool same_str(PyObject* a, PyObject* b) {
    return a == b || (PyUnicode_GET_LENGTH(a) == PyUnicode_GET_LENGTH(b) && PyUnicode_Compare(a, b) == 0);
}

/// An entry's ``(fqn, key)`` in encode_layout's listed-twice check (the strs are its entry's).
struct StateName {
    PyObject* fqn;
    PyObject* key;
    bool same(const StateName& o) const { return same_str(fqn, o.fqn) && same_str(key, o.key); }
};

/// An entry of encode_layout, read: the entry tuple (its FQN and key are its first items) and
/// its chunk in the ChunkPool.
struct EncodeEntry {
    py::object entry;
    size_t chunk = 0;
    py::handle fqn() const { return PyTuple_GET_ITEM(entry.ptr(), 0); }
    py::handle key() const { return PyTuple_GET_ITEM(entry.ptr(), 1); }
};

/// The checked chunks ``(shape, offsets, sizes)`` of encode_layout's entries: per chunk its bytes
/// in the table (u32 ndim, then shape, offsets and sizes as int64) and its element count. An
/// entry whose three dims are the very tuples of one of the last few chunks added (callers share
/// one chunk tuple per parameter shape) is that chunk, unread: a tuple of exact ints cannot
/// change, so reading it again would give the same values and pass the same checks.
class ChunkPool {
public:
    struct Chunk {
        size_t at = 0, len = 0;
        Wide numel = 0;  // the product of the sizes
    };

    /// The chunk of the entry tuple ``entry`` if its dims are a recent chunk's tuples, else kNone.
    size_t find(PyObject* entry) const {
        PyObject* shape = PyTuple_GET_ITEM(entry, 4);
        PyObject* offsets = PyTuple_GET_ITEM(entry, 5);
        PyObject* sizes = PyTuple_GET_ITEM(entry, 6);
        for (const Recent& r : recent_) {
            if (r.shape.ptr() == shape && r.offsets.ptr() == offsets && r.sizes.ptr() == sizes) return r.chunk;
        }
        return kNone;
    }

    /// Add the chunk of ``entry`` read (and checked) as ``shape``, ``offsets`` and ``sizes``.
    size_t add(PyObject* entry, const Dims& shape, const Dims& offsets, const Dims& sizes) {
        Chunk c{bytes_.size(), 0, volume(sizes.v)};
        put_u32(bytes_, static_cast<uint32_t>(shape.v.size()));
        for (const Dims* d : {&shape, &offsets, &sizes}) {
            for (int64_t x : d->v) put_i64(bytes_, x);
        }
        c.len = bytes_.size() - c.at;
        chunks_.push_back(c);
        const size_t index = chunks_.size() - 1;
        PyObject* s = PyTuple_GET_ITEM(entry, 4);
        PyObject* o = PyTuple_GET_ITEM(entry, 5);
        PyObject* z = PyTuple_GET_ITEM(entry, 6);
        if (PyTuple_CheckExact(s) && PyTuple_CheckExact(o) && PyTuple_CheckExact(z)) {
            recent_[next_++ % recent_.size()] = Recent{borrow(s), borrow(o), borrow(z), index};
        }
        return index;
    }

    const Chunk& operator[](size_t i) const { return chunks_[i]; }
    std::string_view bytes(size_t i) const { return {bytes_.data() + chunks_[i].at, chunks_[i].len}; }

private:
    struct Recent {
        py::object shape, offsets, sizes;  // exact tuples (held: their addresses stay theirs)
        size_t chunk = kNone;
    };
    std::vector<Chunk> chunks_;
    std::string bytes_;
    std::array<Recent, 8> recent_;
    size_t next_ = 0;
};

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

    std::vector<EncodeEntry> parsed;
    parsed.reserve(static_cast<size_t>(length(entries)));
    ChunkPool chunks;
    Interner<StateName> seen;  // (fqn, key)
    std::vector<py::object> dtype_order;  // dtypes in order of first appearance
    std::vector<std::vector<std::pair<size_t, Wide>>> by_dtype;  // per dtype: (entry, nbytes)
    py::object dtype_index = steal(PyDict_New());  // dtype str -> index (Python str keys: any text)
    PyObject* last_dtype = nullptr;  // the previous entry's dtype object (kept alive by its entry)
    size_t last_di = 0;
    size_t table_size = 10;  // the table's size (its strs' UTF-8 at least their length; dtypes aside)
    iterate(entries, [&](py::handle e) {
        if (!PyTuple_CheckExact(e.ptr()) || PyTuple_GET_SIZE(e.ptr()) != 7) raise_type("an entry as a tuple of 7", e);
        PyObject* t = e.ptr();
        PyObject* fqn = PyTuple_GET_ITEM(t, 0);
        PyObject* key = PyTuple_GET_ITEM(t, 1);
        PyObject* dtype = PyTuple_GET_ITEM(t, 2);
        PyObject* itemsize = PyTuple_GET_ITEM(t, 3);
        if (!PyUnicode_CheckExact(fqn)) raise_type("the entry's fqn as a str", fqn);
        if (!PyUnicode_CheckExact(key)) raise_type("the entry's key as a str", key);
        if (!PyUnicode_CheckExact(dtype)) raise_type("the entry's dtype as a str", dtype);
        if (!PyLong_CheckExact(itemsize)) raise_type("the entry's item size as an int", itemsize);
        auto where = [&] { return where_of(leaf, key, fqn); };
        size_t ci = chunks.find(t);
        Dims shape, offsets, sizes;
        if (ci == kNone) {
            shape = read_dims(PyTuple_GET_ITEM(t, 4), "a shape");
            offsets = read_dims(PyTuple_GET_ITEM(t, 5), "offsets");
            sizes = read_dims(PyTuple_GET_ITEM(t, 6), "sizes");
        }
        int overflow = 0;
        const long long size = PyLong_AsLongLongAndOverflow(itemsize, &overflow);
        if (size == -1 && PyErr_Occurred()) throw py::error_already_set();
        if (overflow != 0 || size < 1 || size > kMaxItemsize) {
            raise_format_error(Msg() << where() << ": item size " << fmt(itemsize) << " (1 to " << kMaxItemsize << ")");
        }
        if (ci == kNone) {
            py::object problem = check_chunk(where, shape, offsets, sizes);
            if (problem) raise_format_error(problem);
            ci = chunks.add(t, shape, offsets, sizes);
        }
        const StateName name{fqn, key};
        const size_t hash = hash_pair(str_hash(fqn), str_hash(key));
        if (seen.find(hash, name) != kNone) raise_format_error(Msg() << where() << ": listed twice in one layout");
        seen.add(hash, name);
        size_t di = last_di;
        if (dtype != last_dtype) {
            py::object index = dict_get(dtype_index, dtype);
            if (index.is_none()) {
                di = dtype_order.size();
                dtype_order.push_back(borrow(dtype));
                by_dtype.emplace_back();
                py::object n = steal(PyLong_FromSize_t(di));
                check(PyDict_SetItem(dtype_index.ptr(), dtype, n.ptr()));
            } else {
                di = PyLong_AsSize_t(index.ptr());
            }
            last_dtype = dtype;
            last_di = di;
        }
        by_dtype[di].emplace_back(parsed.size(), chunks[ci].numel * size);
        parsed.push_back(EncodeEntry{borrow(t), ci});
        table_size += 8 + static_cast<size_t>(PyUnicode_GET_LENGTH(fqn) + PyUnicode_GET_LENGTH(key)) + chunks.bytes(ci).size();
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
            current.numel += chunks[parsed[i].chunk].numel;
            nbytes += size;
            if (current.numel > static_cast<Wide>(kI64Max)) {
                raise_format_error(Msg() << where_of(leaf, parsed[i].key(), parsed[i].fqn()) << ": its " << fmt(dtype)
                                         << " bucket would hold " << wide_str(current.numel)
                                         << " elements (at most 2**63-1)");
            }
        }
        if (!current.members.empty()) buckets.push_back(std::move(current));
    }

    std::string out;
    out.reserve(table_size + 32 * dtype_order.size());
    out.append(kLayoutMagic, 4);
    put_u16(out, static_cast<uint16_t>(kLayoutVersion));
    put_len_u32(out, static_cast<Py_ssize_t>(buckets.size()));
    py::object result = steal(PyList_New(static_cast<Py_ssize_t>(buckets.size())));
    auto dtype_where = [&] { return Msg() << "leaf " << py_repr(leaf) << ": layout dtype"; };
    Py_ssize_t bi = 0;
    for (const Bucket& b : buckets) {
        put_str(out, b.dtype, dtype_where);
        put_u64(out, static_cast<uint64_t>(b.numel));
        put_len_u32(out, static_cast<Py_ssize_t>(b.members.size()));
        py::object members = steal(PyList_New(static_cast<Py_ssize_t>(b.members.size())));
        Py_ssize_t mi = 0;
        for (const auto& [i, offset] : b.members) {
            const EncodeEntry& e = parsed[i];
            auto where = [&] { return where_of(leaf, e.key(), e.fqn()); };
            put_str(out, e.fqn(), where);
            put_str(out, e.key(), where);
            out.append(chunks.bytes(e.chunk));
            py::object pair = atomic(steal(PyTuple_Pack(2, steal(PyLong_FromSize_t(i)).ptr(),
                                                        steal(PyLong_FromLongLong(static_cast<long long>(offset))).ptr())));
            PyList_SET_ITEM(members.ptr(), mi++, pair.release().ptr());
        }
        py::object entry = py::make_tuple(b.dtype, static_cast<long long>(b.numel), members);
        PyList_SET_ITEM(result.ptr(), bi++, entry.release().ptr());
    }
    return py::make_tuple(steal(PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()))), result);
}

py::object decode_layout(py::object leaf, py::object data) {
    if (!PyUnicode_CheckExact(leaf.ptr())) raise_type("the leaf as a str", leaf);
    if (!PyBytes_CheckExact(data.ptr())) raise_type("a layout table as bytes", data);
    py::object out = steal(PyList_New(0));
    py::object entries;
    Listings listed;
    walk_layout(
        data, Msg() << "leaf " << py_repr(leaf) << " layout table", listed, 0,
        [&](uint32_t, const py::object& dtype, uint64_t numel) {
            entries = steal(PyList_New(0));
            py::object b = py::make_tuple(dtype, steal(PyLong_FromUnsignedLongLong(numel)), entries);
            check(PyList_Append(out.ptr(), b.ptr()));
        },
        [&](uint32_t, const py::object&, uint64_t, const RawEntry& e, Wide) {
            py::object t = py::make_tuple(e.fqn_str(), e.key_str(), dims_tuple(e.shape(), e.n),
                                          dims_tuple(e.offsets(), e.n), dims_tuple(e.sizes(), e.n));
            check(PyList_Append(entries.ptr(), t.ptr()));
        });
    return out;
}

py::tuple plan_scatter(py::object leaf, py::object layouts, py::object chunk_of) {
    if (!PyUnicode_CheckExact(leaf.ptr())) raise_type("the leaf as a str", leaf);
    if (!PyList_CheckExact(layouts.ptr()) && !PyTuple_CheckExact(layouts.ptr())) raise_type("layouts as a list", layouts);
    // The indexes below hold views of the tables' bytes: every table read is kept alive here
    // (chunk_of may change the list) until the plan is made.
    std::vector<py::object> tables;
    Listings listed;          // every (FQN, key) met: its last table, its parameter and target
    Interner<Param> params;   // in order of first appearance
    std::vector<Target> targets;
    std::vector<TargetMore> mores;
    py::object sources = steal(PyList_New(0));
    py::object ops = steal(PyList_New(0));
    std::array<py::object, kMaxNdim + 1> zeros;  // the all-zero tuple of each ndim, when made
    auto zeros_of = [&](size_t n) -> const py::object& {
        if (!zeros[n]) zeros[n] = dims_tuple(std::vector<int64_t>(n, 0));
        return zeros[n];
    };
    SharedObjects keys, shapes, sizes_of;
    size_t li = 0;
    iterate(layouts, [&](py::handle data) {
        if (!PyBytes_CheckExact(data.ptr())) raise_type("a layout table as bytes", data);
        tables.push_back(borrow(data.ptr()));
        py::object where = Msg() << "leaf " << py_repr(leaf) << " layout table " << static_cast<unsigned long long>(li);
        py::object layout_index = steal(PyLong_FromSize_t(li));
        py::object source;  // the current bucket's source number, once it is a source
        walk_layout(
            data, where, listed, li, [&](uint32_t, const py::object&, uint64_t) { source = py::object(); },
            [&](uint32_t bi, const py::object& dtype, uint64_t numel, const RawEntry& e, Wide start) {
                const size_t n = e.n;
                size_t pi = listed[e.listing].param;
                if (pi == kNone) {
                    Param probe{e.fqn, py::object(), Chunk()};
                    pi = params.find(e.hash_fqn, probe);
                    if (pi == kNone) {
                        probe.fqn = e.fqn_str();
                        py::object answer = steal(PyObject_CallOneArg(chunk_of.ptr(), probe.fqn.ptr()));
                        probe.chunk = read_chunk(probe.fqn, answer);
                        pi = params.add(e.hash_fqn, std::move(probe));
                    }
                    listed[e.listing].param = pi;
                }
                const Chunk& mine = params[pi].chunk;
                if (!mine.held) return;
                size_t ti = listed[e.listing].target;
                if (ti != kNone) {
                    const Target& first = targets[ti];
                    const int same_dtype = PyObject_RichCompareBool(first.item(2), dtype.ptr(), Py_EQ);
                    check(same_dtype);
                    if (!same_dtype || !first.same_shape(e.shape_bytes())) {
                        raise_format_error(Msg() << "leaf " << py_repr(leaf) << ": layout tables disagree on state "
                                                 << py_repr(e.key_str()) << " of " << py_repr(e.fqn_str()) << " ("
                                                 << fmt(first.item(2)) << " " << fmt(first.item(3)) << " and " << fmt(dtype)
                                                 << " " << fmt(dims_tuple(e.shape(), n)) << ")");
                    }
                } else {
                    bool same_shape = !mine.shape.big && mine.shape.v.size() == n;
                    for (size_t d = 0; d < n && same_shape; ++d) same_shape = mine.shape.v[d] == e.shape()[d];
                    if (!same_shape) {
                        raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << ": state " << py_repr(e.key_str())
                                                   << " of " << py_repr(e.fqn_str()) << " has shape "
                                                   << fmt(dims_tuple(e.shape(), n)) << " in the checkpoint, the parameter "
                                                   << fmt(mine.shape.obj));
                    }
                    ti = targets.size();
                    listed[e.listing].target = ti;
                    targets.emplace_back();
                    Target& t = targets.back();
                    py::object key = keys.get(e.key, [&] { return e.key_str(); });
                    py::object shape = shapes.get(e.shape_bytes(), [&] { return dims_tuple(e.shape(), n); });
                    t.out = tuple_of({params[pi].fqn.ptr(), key.ptr(), dtype.ptr(), shape.ptr(), mine.offsets.obj.ptr(),
                                      mine.sizes.obj.ptr()});
                    t.index = steal(PyLong_FromSize_t(ti));
                    t.shape_raw = e.raw;
                    t.n = n;
                    t.param = pi;
                }
                Target& t = targets[ti];
                if (!add_seen(t, e.placement(), mores)) return;
                int64_t box[kMaxNdim], src_start[kMaxNdim], dst_start[kMaxNdim];
                bool src_zero = true, dst_zero = true, whole = true;
                const int64_t* offsets = e.offsets();
                const int64_t* sizes = e.sizes();
                for (size_t i = 0; i < n; ++i) {
                    const int64_t lo = std::max(offsets[i], mine.offsets.v[i]);
                    const int64_t hi = std::min(offsets[i] + sizes[i], mine.offsets.v[i] + mine.sizes.v[i]);
                    box[i] = hi - lo;
                    if (box[i] <= 0) return;
                    src_start[i] = lo - offsets[i];
                    dst_start[i] = lo - mine.offsets.v[i];
                    src_zero = src_zero && src_start[i] == 0;
                    dst_zero = dst_zero && dst_start[i] == 0;
                    whole = whole && box[i] == sizes[i];
                }
                if (!source) {
                    source = steal(PyLong_FromSsize_t(PyList_GET_SIZE(sources.ptr())));
                    py::object bucket_index = steal(PyLong_FromUnsignedLong(bi));
                    py::object bucket_numel = steal(PyLong_FromUnsignedLongLong(numel));
                    py::object src = tuple_of({layout_index.ptr(), bucket_index.ptr(), dtype.ptr(), bucket_numel.ptr()});
                    check(PyList_Append(sources.ptr(), src.ptr()));
                }
                py::object sizes_obj = sizes_of.get(e.sizes_bytes(), [&] { return dims_tuple(sizes, n); });
                py::object src_obj = src_zero ? zeros_of(n) : dims_tuple(src_start, n);
                py::object dst_obj = dst_zero ? zeros_of(n) : dims_tuple(dst_start, n);
                py::object box_obj = whole ? sizes_obj : dims_tuple(box, n);
                py::object start_obj = steal(PyLong_FromLongLong(static_cast<long long>(start)));
                py::object op = tuple_of({source.ptr(), start_obj.ptr(), sizes_obj.ptr(), src_obj.ptr(), t.index.ptr(),
                                          dst_obj.ptr(), box_obj.ptr()});
                check(PyList_Append(ops.ptr(), op.ptr()));
                t.covered += volume(box, n);
                add_box(t, e.placement(), mores);
            });
        ++li;
    });
    py::object out_targets = steal(PyList_New(static_cast<Py_ssize_t>(targets.size())));
    for (size_t ti = 0; ti < targets.size(); ++ti) {
        const Target& t = targets[ti];
        const Chunk& mine = params[t.param].chunk;
        const auto [a, b] = first_overlap(t, mine, mores);
        if (a >= 0) {
            auto dims_at = [&](long box, size_t part) {
                const char* p = t.box(static_cast<size_t>(box), mores) + 8 * t.n * part;
                std::vector<int64_t> v(t.n);
                for (size_t d = 0; d < t.n; ++d) v[d] = static_cast<int64_t>(get_le(p + 8 * d, 8));
                return dims_tuple(v);
            };
            raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << ": state " << py_repr(t.item(1)) << " of "
                                       << py_repr(t.item(0)) << ": the checkpoint's layouts overlap (chunks at offsets "
                                       << fmt(dims_at(a, 0)) << " of sizes " << fmt(dims_at(a, 1)) << " and at offsets "
                                       << fmt(dims_at(b, 0)) << " of sizes " << fmt(dims_at(b, 1))
                                       << "): a damaged or edited checkpoint");
        }
        const Wide need = volume(mine.sizes.v);
        if (t.covered != need) {
            raise_mismatch_error(Msg() << "leaf " << py_repr(leaf) << ": state " << py_repr(t.item(1)) << " of "
                                       << py_repr(t.item(0)) << ": the checkpoint's buffers cover " << wide_str(t.covered)
                                       << " of the " << wide_str(need)
                                       << " elements of this rank's chunk (a buffer or layout table is missing from the "
                                          "checkpoint)");
        }
        PyList_SET_ITEM(out_targets.ptr(), static_cast<Py_ssize_t>(ti), borrow(t.out.ptr()).release().ptr());
    }
    return py::make_tuple(out_targets, sources, ops);
}

}  // namespace sckpt
