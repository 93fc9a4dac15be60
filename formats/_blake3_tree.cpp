// BLAKE3 of a whole written range and of a whole input (formats/blake3_tree.py): compiled after
// _blake3_native.cpp in one translation unit (its compression, hq_b3_subtree, hq_b3_parent).

// The bytes are read from a file (pread) or taken from memory.

namespace {

constexpr int64_t MAX_SUBTREE = 1 << 12;  // chunks per node hashed at once (4 MiB read)

// Where the input's bytes are: in memory, byte i at address base + i (base is the input's byte 0
// as an address: integer arithmetic, since it may lie before the buffer that holds the bytes, or
// even be 0 — a buffer whose address equals its offset, as on a non-PIE Python's heap), else in
// the file fd.
struct Input {
  int fd;
  uintptr_t base;
  bool in_memory;
};

// Bytes [off, off + n) of the input: in memory, or read from fd into this thread's buffer.
const uint8_t* bytes_at(const Input& in, int64_t off, int64_t n) {
  if (in.in_memory) return reinterpret_cast<const uint8_t*>(in.base + uintptr_t(off));
  const int fd = in.fd;
  thread_local std::vector<uint8_t> buf;
  if (int64_t(buf.size()) < n) buf.resize(size_t(std::max(n, MAX_SUBTREE * CHUNK)));
  for (int64_t done = 0; done < n;) {
    ssize_t r = pread(fd, buf.data() + done, size_t(n - done), off + done);
    if (r <= 0) return nullptr;
    done += r;
  }
  return buf.data();
}

int64_t pow2_floor(int64_t x) { return int64_t(1) << (63 - __builtin_clzll(uint64_t(x))); }

int64_t node_bytes(int64_t first, int64_t k, int64_t size) {
  return std::min((first + k) * CHUNK, size) - first * CHUNK;
}

// The chaining value of node (first, k) hashed from the input; false on a read error.
bool hash_node(const Input& in, int64_t size, int64_t first, int64_t k, int lanes, uint8_t* cv) {
  int64_t n = node_bytes(first, k, size);
  const uint8_t* p = bytes_at(in, first * CHUNK, n);
  return p && hq_b3_subtree(p, n, uint64_t(first), cv, lanes) == 0;
}

struct Known {
  const int64_t *first, *k;
  const uint8_t* cv;
  int64_t n;
};

// The node (first, k) of an input of `size` bytes: a known chaining value, else hashed (an aligned
// power of two with no known node inside, at most MAX_SUBTREE chunks), else its two children
// merged. root: the digest instead. Returns false on a read error.
bool node(const Known& kn, const Input& in, int64_t size, int64_t first, int64_t k,
          bool root, int lanes, uint8_t* out) {
  const int64_t* at = std::lower_bound(kn.first, kn.first + kn.n, first);
  int64_t i = at - kn.first;
  bool starts_inside = i < kn.n && kn.first[i] < first + k;
  if (!root && starts_inside && kn.first[i] == first && kn.k[i] == k) {
    memcpy(out, kn.cv + 32 * i, 32);
    return true;
  }
  bool pow2 = (k & (k - 1)) == 0;
  if (!root && pow2 && k <= MAX_SUBTREE && (k == 1 || !starts_inside))
    return hash_node(in, size, first, k, lanes, out);
  int64_t left = pow2_floor(k - 1);
  uint8_t l[32], r[32];
  if (!node(kn, in, size, first, left, false, lanes, l) ||
      !node(kn, in, size, first + left, k - left, false, lanes, r))
    return false;
  hq_b3_parent(l, r, root, out);
  return true;
}

}  // namespace

extern "C" {

// The tree nodes wholly inside bytes [start, end) of an input of `size` bytes (from mem, which
// holds the input's bytes from byte mem_at on and at least up to end, or read from fd when mem is
// null), greedily largest first, at most MAX_SUBTREE chunks each, never the root: each one's
// first chunk, chunk count and chaining value (32 bytes) into first[i], k[i], cv[32 i]. Returns
// the count, -1 on a read error (errno set), -2 if more than cap.
// The nodes are hashed a window of at most MAX_SUBTREE chunks at a time (one read): the chunks of
// all the window's nodes compressed together, `lanes` at a time, then each node's parents (a
// range starts and ends at any chunk, so its edge nodes are short runs of 8, 4, 2, 1 chunks:
// hashed node by node, as until 2026-11-29, those went one chunk at a time).
int64_t hq_b3_range(int fd, const uint8_t* mem, int64_t mem_at, int64_t size, int64_t start,
                    int64_t end, int64_t* first, int64_t* k, uint8_t* cv, int64_t cap, int lanes) {
  // Only bytes from start on, inside the buffer, are read through the input's base.
  const Input in{fd, reinterpret_cast<uintptr_t>(mem) - uintptr_t(mem_at), mem != nullptr};
  int64_t n = std::max<int64_t>(1, (size + CHUNK - 1) / CHUNK);
  if (n == 1) return 0;  // a one-chunk input is hashed whole by hq_b3_root
  int64_t at = (start + CHUNK - 1) / CHUNK, stop = end >= size ? n : end / CHUNK, count = 0;
  const int path = pick(lanes);
  thread_local std::vector<uint32_t> window(size_t(MAX_SUBTREE) * 8);
  auto cvs = reinterpret_cast<uint32_t(*)[8]>(window.data());
  while (at < stop) {
    const int64_t w0 = at, listed = count;  // this window's first chunk and node
    for (; at < stop; at += k[count - 1]) {  // its nodes: as many as fit in MAX_SUBTREE chunks
      int64_t kk = std::min({at ? (at & -at) : MAX_SUBTREE, pow2_floor(stop - at), MAX_SUBTREE});
      if (kk >= n) kk = pow2_floor(n - 1);  // never the root
      if (at + kk - w0 > MAX_SUBTREE) break;
      if (count == cap) return -2;
      first[count] = at, k[count] = kk, ++count;
    }
    const int64_t nbytes = node_bytes(w0, at - w0, size);
    const uint8_t* p = bytes_at(in, w0 * CHUNK, nbytes);
    if (!p) return -1;
    chunk_cvs(p, nbytes, uint64_t(w0), path, cvs);
    for (int64_t i = listed; i < count; ++i) {
      merge_node(cvs + (first[i] - w0), k[i], path);
      cv_bytes(cvs[first[i] - w0], cv + 32 * i);
    }
  }
  return count;
}

// Merges sibling nodes of an input of `size` bytes in place: the n nodes (first ascending,
// disjoint) become the fewest that cover the same chunks, two nodes of k chunks that are the two
// halves of an aligned node of 2k merged into it (its chaining value their parent's), never into
// the root. Returns the new count.
int64_t hq_b3_compact(int64_t* first, int64_t* k, uint8_t* cv, int64_t n, int64_t size) {
  int64_t chunks = std::max<int64_t>(1, (size + CHUNK - 1) / CHUNK), top = 0;
  for (int64_t i = 0; i < n; ++i) {
    first[top] = first[i], k[top] = k[i];
    if (top != i) memcpy(cv + 32 * top, cv + 32 * i, 32);
    ++top;
    while (top >= 2) {  // the last two: the halves of one node, not the root?
      int64_t a = top - 2, b = top - 1, kk = k[a];
      if (k[b] != kk || first[b] != first[a] + kk || first[a] % (2 * kk) || 2 * kk >= chunks)
        break;
      hq_b3_parent(cv + 32 * a, cv + 32 * b, 0, cv + 32 * a);
      k[a] = 2 * kk;
      top = b;
    }
  }
  return top;
}

// The digest (32 bytes) of an input of `size` bytes from the n known nodes (first ascending, as
// hq_b3_range gives them; disjoint), hashing what they do not cover from mem or fd. Returns 0,
// -1 on a read error.
int hq_b3_root(int fd, const uint8_t* mem, int64_t size, const int64_t* first, const int64_t* k,
               const uint8_t* cv, int64_t n, uint8_t* out, int lanes) {
  int64_t chunks = std::max<int64_t>(1, (size + CHUNK - 1) / CHUNK);
  const Input in{fd, reinterpret_cast<uintptr_t>(mem), mem != nullptr};
  if (chunks == 1) {
    const uint8_t* p = size ? bytes_at(in, 0, size) : mem;
    uint8_t zero = 0;
    return p || !size ? hq_b3_single(p ? p : &zero, size, out) : -1;
  }
  return node(Known{first, k, cv, n}, in, size, 0, chunks, true, lanes, out) ? 0 : -1;
}

}  // extern "C"
