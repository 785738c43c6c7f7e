/* domus._recordtree: RecordTree, one bucket's records as bytes, in key order.
 *
 * A RecordTree maps bytes keys to bytes values, ordered bytewise by key, and
 * keeps every record -- its tree links, its key and its value -- inside one
 * block of memory of its own, the tree's *arena*: no Python object and no
 * malloc per record.  domus/storage/recordtree.py holds the pure-Python twin
 * (same methods, same errors and messages, same allocator accounting) that
 * tests/unit/test_recordtree.py runs side by side with this one.
 *
 * Records.  The arena is an array of 8-byte units; a record is a run of
 * units starting on a unit, named by the index of its first unit (unit 0
 * is a black nil and never written):
 *
 *     u32 link[2]   left child (bit 31: the node is red), right child
 *     u16 meta      key length (bits 0-13, up to 16,383), value-length bytes - 1
 *                   (bits 14-15)
 *     key           the key's bytes
 *     vlen          the value's length, little-endian, in 1 to 4 bytes
 *     value         the value's bytes
 *
 * rounded up to whole units.  An int key of Domus's encoding (9 bytes) with
 * an 8-byte msgpack value (10 bytes) is 30 bytes, 4 units: 32 bytes a
 * record.  Keys compare with memcmp (8 bytes at a time), so a descent reads
 * the node's links and key where they sit together.  Child links are 31-bit
 * unit indices, so one arena holds at most 16 GiB.
 *
 * The allocator.  New records are carved from the top of the arena (a bump
 * index); the arena doubles when full.  A freed record becomes a free block
 * (link[1] is FREE_BIT | its size in units, which no live node's right link
 * can be: indices have 31 bits); blocks under LISTED_UNITS units go on a
 * list of blocks of exactly that size (through link[0]), which the next
 * record of that size takes, larger ones are holes.  Whenever free units
 * pass a quarter of the arena's used units (and it uses at least
 * COMPACT_MIN_BYTES), the tree is *compacted* in place: one pass along the
 * arena marks the free units in a bitmap, a second slides every live record
 * down over the free space before it and rewrites its links (a record's new
 * index is its old one less the free units before it, which the bitmap and
 * a running count per 64 units give at once), and the arena shrinks to what
 * is left.  Both passes read the arena in order, so a compaction costs
 * about what copying the arena does.  So deletes make room for later
 * records at once, no more than a quarter of the units in use is ever free
 * for long, and a tree that shrinks gives its memory back.  A tree that becomes empty frees its arena
 * altogether.  Arenas under MAP_THRESHOLD bytes come from PyMem_Realloc;
 * larger ones are private anonymous mappings, grown with mremap, advised
 * against transparent huge pages (a 2 MiB page per bucket would make RSS
 * jump in 2 MiB steps), of which only the pages below the top are ever
 * touched.  `bytes_held` is what the allocator holds: a mapping's pages up
 * to the top, a smaller arena's whole block, and the free-list heads.  The
 * twin computes the same figure by the same rules.
 *
 * Nothing here runs Python code: keys and values are bytes, compared and
 * copied in C.  Every operation either completes or, failing to allocate,
 * raises MemoryError with the tree unchanged; deletes never fail (a
 * compaction that cannot get memory is skipped).
 *
 * Iterators hold unit indices on a stack.  `version` counts insertions,
 * removals and clears: an iterator raises RuntimeError at its next step once
 * it moved.  `layout` also counts every record that moved (a value replaced
 * by one of another size lands elsewhere; a compaction moves them all):
 * an iterator then finds its place again from the last key it returned, so
 * replacing values while iterating is fine, as with dict.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "recordtree_api.h"

#define UNIT 8
#define UNIT_SHIFT 3
#define RED_BIT 0x80000000u
#define FREE_BIT 0x80000000u    /* in link[1]: a free block */
#define INDEX_MASK 0x7FFFFFFFu
#define MAX_UNITS ((uint64_t)INDEX_MASK)    /* 16 GiB of arena */
#define KEY_BITS 0x3FFFu
#define WIDTH_SHIFT 14
#define MAX_KEY_BYTES KEY_BITS            /* 16,383: the protocol's is 8,192 */
#define MAX_VALUE_BYTES 0xFFFFFFFFu         /* 4 GiB - 1: the protocol's is 16 MiB */
#define MAX_DEPTH 96            /* > 2 log2(2^31) + 1 */
#define LISTED_UNITS 256        /* free blocks under 2 KiB are listed */
#define MIN_CAPACITY 64
#define MAP_THRESHOLD (64 * 1024)
#define COMPACT_MIN_BYTES 4096

typedef struct {
    uint32_t link[2];       /* left (with the colour bit), right; 0 is nil */
    uint16_t meta;          /* key length | (value-length bytes - 1) << 14 */
    unsigned char key[];    /* then vlen and the value */
} Node;

#define HEADER_BYTES offsetof(Node, key)

typedef struct {
    PyObject_HEAD
    unsigned char *base;    /* the arena; NULL while the tree is empty */
    size_t capacity;        /* bytes of the arena */
    int mapped;             /* the arena is an mmap (else PyMem) */
    uint32_t top;           /* units handed out, the nil unit included */
    uint32_t root;
    Py_ssize_t size;
    uint64_t version;       /* insertions, removals, clears */
    uint64_t layout;        /* version changes and records that moved */
    uint64_t free_units;    /* units of free blocks, listed or not */
    uint32_t *free_heads;   /* free_heads[u]: a free block of u units, or 0 */
    uint32_t free_classes;  /* length of free_heads */
    uint64_t compactions;
} TreeObject;

/* The way down from the root: node[i + 1] is child side[i] of node[i]. */
typedef struct {
    uint32_t node[MAX_DEPTH];
    uint8_t side[MAX_DEPTH];
    int depth;
} Path;

/* Nodes still to visit in order, the next one on top. */
typedef struct {
    uint32_t node[MAX_DEPTH];
    int depth;
} Walk;

enum { BOUND_CEIL, BOUND_HIGHER, BOUND_FLOOR, BOUND_LOWER };
enum { MODE_KEYS, MODE_VALUES, MODE_ITEMS };

static PyTypeObject Tree_Type;
static PyTypeObject Iter_Type;
static PyObject *KeyTooLarge;       /* domus.errors */
static PyObject *ValueTooLarge;
static size_t page_size;

static const char ITER_CHANGED[] = "RecordTree changed size during iteration";

/* ------------------------------------------------------------ nodes */

static inline Node *
node_at(const TreeObject *t, uint32_t x)
{
    return (Node *)(t->base + ((size_t)x << UNIT_SHIFT));
}

static inline uint32_t
child(const TreeObject *t, uint32_t x, int side)
{
    return node_at(t, x)->link[side] & INDEX_MASK;
}

static inline void
set_child(TreeObject *t, uint32_t x, int side, uint32_t y)
{
    Node *n = node_at(t, x);
    n->link[side] = (n->link[side] & RED_BIT) | y;
}

static inline int
is_red(const TreeObject *t, uint32_t x)
{
    return (int)(node_at(t, x)->link[0] >> 31);
}

static inline void
set_red(TreeObject *t, uint32_t x)
{
    node_at(t, x)->link[0] |= RED_BIT;
}

static inline void
set_black(TreeObject *t, uint32_t x)
{
    node_at(t, x)->link[0] &= INDEX_MASK;
}

static inline size_t
key_length(const Node *n)
{
    return n->meta & KEY_BITS;
}

static inline int
value_width(const Node *n)
{
    return (n->meta >> WIDTH_SHIFT) + 1;
}

static inline size_t
value_length(const Node *n)
{
    const unsigned char *p = n->key + key_length(n);
    size_t length = 0;
    for (int i = value_width(n) - 1; i >= 0; i--) {
        length = (length << 8) | p[i];
    }
    return length;
}

static inline const unsigned char *
value_bytes(const Node *n)
{
    return n->key + key_length(n) + value_width(n);
}

/* Bytes that hold a value's length. */
static inline int
width_for(size_t value_size)
{
    return value_size < 0x100 ? 1 : value_size < 0x10000 ? 2
           : value_size < 0x1000000 ? 3 : 4;
}

/* Units of a record of a key and a value of these sizes. */
static inline uint32_t
record_units(size_t key_size, size_t value_size)
{
    return (uint32_t)((HEADER_BYTES + key_size + width_for(value_size)
                       + value_size + UNIT - 1) >> UNIT_SHIFT);
}

static inline uint32_t
node_units(const Node *n)
{
    return record_units(key_length(n), value_length(n));
}

/* The value (its length, then its bytes) of a node whose key is written. */
static void
value_write(Node *n, const unsigned char *value, size_t value_size)
{
    int width = width_for(value_size);
    size_t key_size = key_length(n);
    n->meta = (uint16_t)(key_size | ((unsigned)(width - 1) << WIDTH_SHIFT));
    unsigned char *p = n->key + key_size;
    for (int i = 0; i < width; i++) {
        p[i] = (unsigned char)(value_size >> (8 * i));
    }
    memcpy(p + width, value, value_size);
}

static void
record_write(Node *n, const unsigned char *key, size_t key_size,
             const unsigned char *value, size_t value_size)
{
    n->meta = (uint16_t)key_size;
    memcpy(n->key, key, key_size);
    value_write(n, value, value_size);
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define BIG_ENDIAN_64(v) __builtin_bswap64(v)
#else
#define BIG_ENDIAN_64(v) (v)
#endif

static inline uint64_t
load_be64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return BIG_ENDIAN_64(v);
}

/* Bytewise order: <0, 0, >0 as a sorts before, with, after b. */
static inline int
compare_keys(const unsigned char *a, size_t a_size,
             const unsigned char *b, size_t b_size)
{
    size_t common = a_size < b_size ? a_size : b_size;
    size_t i = 0;
    for (; i + 8 <= common; i += 8) {
        uint64_t x = load_be64(a + i), y = load_be64(b + i);
        if (x != y) {
            return x < y ? -1 : 1;
        }
    }
    if (i < common) {
        int c = memcmp(a + i, b + i, common - i);
        if (c != 0) {
            return c;
        }
    }
    return (a_size > b_size) - (a_size < b_size);
}

static inline int
compare_node(const TreeObject *t, const unsigned char *key, size_t key_size,
             uint32_t x)
{
    const Node *n = node_at(t, x);
    return compare_keys(key, key_size, n->key, key_length(n));
}

/* ------------------------------------------------------------ the arena */

static size_t
round_up(size_t n, size_t multiple)
{
    return (n + multiple - 1) / multiple * multiple;
}

/* A new private anonymous mapping of `size` bytes, or NULL. */
static unsigned char *
map_new(size_t size)
{
    void *block = mmap(NULL, size, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) {
        return NULL;
    }
#ifdef MADV_NOHUGEPAGE
    (void)madvise(block, size, MADV_NOHUGEPAGE);
#endif
    return block;
}

/* Resize the mapping at `old` (old_size bytes, the first `used` in use) to
 * `size` bytes; NULL, with `old` untouched, if that fails. */
static unsigned char *
map_resize(unsigned char *old, size_t old_size, size_t used, size_t size)
{
#ifdef MREMAP_MAYMOVE
    void *block = mremap(old, old_size, size, MREMAP_MAYMOVE);
    if (block == MAP_FAILED) {
        return NULL;
    }
#ifdef MADV_NOHUGEPAGE
    (void)madvise(block, size, MADV_NOHUGEPAGE);
#endif
    return block;
#else
    unsigned char *block = map_new(size);
    if (block == NULL) {
        return NULL;
    }
    memcpy(block, old, used);
    munmap(old, old_size);
    return block;
#endif
}

static void
arena_free(unsigned char *base, size_t capacity, int mapped)
{
    if (base == NULL) {
        return;
    }
    if (mapped) {
        munmap(base, capacity);
    }
    else {
        PyMem_Free(base);
    }
}

/* The capacity an arena of at least `needed` bytes gets: whole pages once
 * it is mapped. */
static size_t
arena_size_for(size_t needed)
{
    if (needed < MIN_CAPACITY) {
        return MIN_CAPACITY;
    }
    return needed >= MAP_THRESHOLD ? round_up(needed, page_size) : needed;
}

/* Make room for `units` units in all: the arena grows to twice its size,
 * or more if that is not enough.  -1 with MemoryError, arena unchanged. */
static int
arena_reserve(TreeObject *t, uint64_t units)
{
    if (units > MAX_UNITS) {
        PyErr_SetString(PyExc_MemoryError, "a RecordTree holds at most "
                        "16 GiB of records (one bucket); use more buckets");
        return -1;
    }
    size_t needed = (size_t)units << UNIT_SHIFT;
    if (needed <= t->capacity) {
        return 0;
    }
    size_t doubled = t->capacity * 2;
    if (doubled > (size_t)(MAX_UNITS << UNIT_SHIFT)) {
        doubled = (size_t)(MAX_UNITS << UNIT_SHIFT);
    }
    size_t capacity = arena_size_for(doubled > needed ? doubled : needed);
    unsigned char *base;
    size_t used = (size_t)t->top << UNIT_SHIFT;
    if (capacity >= MAP_THRESHOLD) {
        if (t->mapped) {
            base = map_resize(t->base, t->capacity, used, capacity);
        }
        else {
            base = map_new(capacity);
            if (base != NULL && t->base != NULL) {
                memcpy(base, t->base, used);
                PyMem_Free(t->base);
            }
        }
    }
    else {
        base = PyMem_Realloc(t->base, capacity);
    }
    if (base == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->base = base;
    t->capacity = capacity;
    t->mapped = capacity >= MAP_THRESHOLD;
    return 0;
}

/* Forget every record and give the arena back. */
static void
arena_release(TreeObject *t)
{
    arena_free(t->base, t->capacity, t->mapped);
    PyMem_Free(t->free_heads);
    t->base = NULL;
    t->capacity = 0;
    t->mapped = 0;
    t->top = 0;
    t->root = 0;
    t->size = 0;
    t->free_units = 0;
    t->free_heads = NULL;
    t->free_classes = 0;
}

/* A block of `units` units: a listed free block of that size if there is
 * one, else a new one from the top.  0 with MemoryError, tree unchanged. */
static uint32_t
node_alloc(TreeObject *t, uint32_t units)
{
    if (units < t->free_classes && t->free_heads[units] != 0) {
        uint32_t x = t->free_heads[units];
        t->free_heads[units] = node_at(t, x)->link[0];
        t->free_units -= units;
        return x;
    }
    int fresh = t->top == 0;
    uint64_t first = fresh ? 1 : t->top;
    if (arena_reserve(t, first + units) < 0) {
        return 0;
    }
    if (fresh) {
        memset(t->base, 0, UNIT);   /* the nil: black, no children */
    }
    t->top = (uint32_t)(first + units);
    return (uint32_t)first;
}

/* Make the block x of `units` units free: listed for reuse if it is small
 * (a free-list table that cannot grow leaves it a hole), a hole if not. */
static void
node_free(TreeObject *t, uint32_t x, uint32_t units)
{
    Node *n = node_at(t, x);
    n->link[0] = 0;
    n->link[1] = FREE_BIT | units;
    t->free_units += units;
    if (units >= LISTED_UNITS) {
        return;
    }
    if (units >= t->free_classes) {
        uint32_t *heads = PyMem_Realloc(t->free_heads,
                                        (units + 1) * sizeof(uint32_t));
        if (heads == NULL) {
            return;
        }
        memset(heads + t->free_classes, 0,
               (units + 1 - t->free_classes) * sizeof(uint32_t));
        t->free_heads = heads;
        t->free_classes = units + 1;
    }
    n->link[0] = t->free_heads[units];
    t->free_heads[units] = x;
}

/* ------------------------------------------------------------ walking */

static inline void
walk_descend(const TreeObject *t, Walk *walk, uint32_t x, int reverse)
{
    while (x != 0) {
        walk->node[walk->depth++] = x;
        x = child(t, x, reverse);
    }
}

/* The next node of an in-order walk (descending if reverse), or 0. */
static inline uint32_t
walk_next(const TreeObject *t, Walk *walk, int reverse)
{
    if (walk->depth == 0) {
        return 0;
    }
    uint32_t x = walk->node[--walk->depth];
    walk_descend(t, walk, child(t, x, !reverse), reverse);
    return x;
}

/* Start an in-order walk at the first key (reverse: the last). */
static void
walk_start(const TreeObject *t, Walk *walk, int reverse)
{
    walk->depth = 0;
    if (t->size != 0) {
        walk_descend(t, walk, t->root, reverse);
    }
}

/* Start a walk at the smallest key >= (CEIL), > (HIGHER), or the largest
 * key <= (FLOOR), < (LOWER) `key`: the stack holds the nodes the descent
 * took on the walk's side, the first to visit on top. */
static void
walk_from(const TreeObject *t, Walk *walk, const unsigned char *key,
          size_t key_size, int which)
{
    int ascending = which == BOUND_CEIL || which == BOUND_HIGHER;
    uint32_t x = t->size != 0 ? t->root : 0;
    walk->depth = 0;
    while (x != 0) {
        int c = compare_node(t, key, key_size, x);
        int take;
        switch (which) {
        case BOUND_CEIL:
            take = c <= 0;
            break;
        case BOUND_HIGHER:
            take = c < 0;
            break;
        case BOUND_FLOOR:
            take = c >= 0;
            break;
        default:
            take = c > 0;
            break;
        }
        if (take) {
            walk->node[walk->depth++] = x;
            if (c == 0) {
                break;
            }
        }
        /* from a taken node ascending walks go left, descending right */
        x = child(t, x, take ? !ascending : ascending);
    }
}

/* ------------------------------------------------------------ searching */

/* The node holding `key`, or 0. */
static inline uint32_t
tree_find(const TreeObject *t, const unsigned char *key, size_t key_size)
{
    uint32_t x = t->size != 0 ? t->root : 0;
    while (x != 0) {
        const Node *n = node_at(t, x);
        int c = compare_keys(key, key_size, n->key, key_length(n));
        if (c == 0) {
            return x;
        }
        x = n->link[c > 0] & INDEX_MASK;
    }
    return 0;
}

/* The node holding `key` (then path->node[path->depth] is that node) or 0
 * (then path->node[path->depth - 1], side path->side[path->depth - 1], is
 * the empty link a new node hangs on); the way down in `path`. */
static uint32_t
tree_locate(const TreeObject *t, const unsigned char *key, size_t key_size,
            Path *path)
{
    uint32_t x = t->size != 0 ? t->root : 0;
    int depth = 0;
    while (x != 0) {
        int c = compare_node(t, key, key_size, x);
        if (c == 0) {
            path->node[depth] = x;
            path->depth = depth;
            return x;
        }
        path->node[depth] = x;
        path->side[depth] = (uint8_t)(c > 0);
        depth++;
        x = child(t, x, c > 0);
    }
    path->depth = depth;
    return 0;
}

/* ------------------------------------------------------------ rebalancing
 *
 * CLRS, "Introduction to Algorithms", chapter 13, walking the path from the
 * root instead of parent links (there are none). */

/* Rotate around x, whose parent is `up` (0: x is the root): side 0 lifts
 * x's right child into x's place (a left rotation), side 1 its left. */
static void
rotate(TreeObject *t, uint32_t x, int side, uint32_t up)
{
    uint32_t y = child(t, x, !side);
    set_child(t, x, !side, child(t, y, side));
    set_child(t, y, side, x);
    if (up == 0) {
        t->root = y;
    }
    else {
        set_child(t, up, child(t, up, 1) == x, y);
    }
}

/* Restore the red-black properties after linking the red node
 * path->node[i] (RB-INSERT-FIXUP). */
static void
insert_fixup(TreeObject *t, Path *path, int i)
{
    uint32_t *node = path->node;
    while (i >= 2 && is_red(t, node[i - 1])) {
        uint32_t parent = node[i - 1], grand = node[i - 2];
        int side = path->side[i - 2];
        uint32_t uncle = child(t, grand, !side);
        if (is_red(t, uncle)) {
            set_black(t, parent);
            set_black(t, uncle);
            set_red(t, grand);
            i -= 2;
            continue;
        }
        if (path->side[i - 1] != side) {
            /* inner grandchild: lift it into its parent's place */
            rotate(t, parent, side, grand);
            parent = node[i];
        }
        set_black(t, parent);
        set_red(t, grand);
        rotate(t, grand, !side, i >= 3 ? node[i - 3] : 0);
        break;
    }
    set_black(t, t->root);
}

/* Restore the red-black properties after a black node was unlinked and
 * replaced by x, which sits below path->node[i - 1] on side
 * path->side[i - 1] (RB-DELETE-FIXUP). */
static void
delete_fixup(TreeObject *t, Path *path, int i, uint32_t x)
{
    uint32_t *node = path->node;
    while (i > 0 && !is_red(t, x)) {
        uint32_t parent = node[i - 1];
        int side = path->side[i - 1];
        uint32_t sibling = child(t, parent, !side);
        if (is_red(t, sibling)) {
            set_black(t, sibling);
            set_red(t, parent);
            rotate(t, parent, side, i >= 2 ? node[i - 2] : 0);
            /* the sibling took the parent's place: x is one level deeper */
            node[i - 1] = sibling;
            path->side[i - 1] = (uint8_t)side;
            node[i] = parent;
            path->side[i] = (uint8_t)side;
            i++;
            sibling = child(t, parent, !side);
        }
        if (!is_red(t, child(t, sibling, 0))
                && !is_red(t, child(t, sibling, 1))) {
            set_red(t, sibling);
            x = parent;
            i--;
            continue;
        }
        if (!is_red(t, child(t, sibling, !side))) {
            set_black(t, child(t, sibling, side));
            set_red(t, sibling);
            rotate(t, sibling, !side, parent);
            sibling = child(t, parent, !side);
        }
        if (is_red(t, parent)) {
            set_red(t, sibling);
        }
        else {
            set_black(t, sibling);
        }
        set_black(t, parent);
        set_black(t, child(t, sibling, !side));
        rotate(t, parent, side, i >= 2 ? node[i - 2] : 0);
        x = t->root;
        break;
    }
    if (x != 0) {
        set_black(t, x);
    }
}

/* Unlink the node z = path->node[path->depth] and rebalance.  A node with
 * two children is replaced by its successor y, which takes z's place,
 * children and colour (RB-DELETE): records cannot trade places, as they
 * differ in size. */
static void
delete_at(TreeObject *t, Path *path)
{
    int i = path->depth;
    uint32_t z = path->node[i];
    uint32_t x;
    int removed_red;
    if (child(t, z, 0) != 0 && child(t, z, 1) != 0) {
        int at = i;
        path->side[i] = 1;
        uint32_t y = child(t, z, 1);
        path->node[++i] = y;
        for (uint32_t next; (next = child(t, y, 0)) != 0; y = next) {
            path->side[i] = 0;
            path->node[++i] = next;
        }
        /* y (path->node[i]) has no left child */
        x = child(t, y, 1);
        removed_red = is_red(t, y);
        if (i == at + 1) {
            /* y is z's right child: x stays below y, on its right */
        }
        else {
            set_child(t, path->node[i - 1], 0, x);
            set_child(t, y, 1, child(t, z, 1));
        }
        set_child(t, y, 0, child(t, z, 0));
        if (is_red(t, z)) {
            set_red(t, y);
        }
        else {
            set_black(t, y);
        }
        if (at == 0) {
            t->root = y;
        }
        else {
            set_child(t, path->node[at - 1], path->side[at - 1], y);
        }
        path->node[at] = y;
        /* x hangs below path->node[i - 1] (y itself when it was z's right
         * child), on side path->side[i - 1] */
    }
    else {
        x = child(t, z, 0) ? child(t, z, 0) : child(t, z, 1);
        removed_red = is_red(t, z);
        if (i == 0) {
            t->root = x;
        }
        else {
            set_child(t, path->node[i - 1], path->side[i - 1], x);
        }
    }
    if (!removed_red) {
        delete_fixup(t, path, i, x);
    }
}

/* ------------------------------------------------------------ compaction */

/* The units of the block at x, free or live. */
static inline uint32_t
block_units(const TreeObject *t, uint32_t x)
{
    const Node *n = node_at(t, x);
    return (n->link[1] & FREE_BIT) ? (n->link[1] & INDEX_MASK) : node_units(n);
}

/* Bits set in v (SWAR: without -mpopcnt, __builtin_popcountll is a call). */
static inline uint32_t
popcount64(uint64_t v)
{
    v = v - ((v >> 1) & 0x5555555555555555ULL);
    v = (v & 0x3333333333333333ULL) + ((v >> 2) & 0x3333333333333333ULL);
    v = (v + (v >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (uint32_t)((v * 0x0101010101010101ULL) >> 56);
}

/* Shrink the arena to `capacity` bytes (at least its used units): a
 * mapping gives its tail pages back, or becomes a PyMem block once small;
 * a PyMem block is reallocated.  If that cannot be done, it stays as it is. */
static void
arena_shrink(TreeObject *t, size_t capacity)
{
    if (capacity >= t->capacity) {
        return;
    }
    size_t used = (size_t)t->top << UNIT_SHIFT;
    if (t->mapped && capacity >= MAP_THRESHOLD) {
        if (munmap(t->base + capacity, t->capacity - capacity) == 0) {
            t->capacity = capacity;
        }
        return;
    }
    if (t->mapped) {
        unsigned char *base = PyMem_Malloc(capacity);
        if (base == NULL) {
            return;
        }
        memcpy(base, t->base, used);
        munmap(t->base, t->capacity);
        t->base = base;
        t->capacity = capacity;
        t->mapped = 0;
        return;
    }
    unsigned char *base = PyMem_Realloc(t->base, capacity);
    if (base != NULL) {
        t->base = base;
        t->capacity = capacity;
    }
}

/* Slide every live record down over the free blocks before it, rewrite the
 * links, and shrink the arena to what is left; the tree's shape is kept.
 * If memory for the bitmap cannot be had, nothing changes. */
static void
tree_compact(TreeObject *t)
{
    uint32_t top = t->top;
    size_t words = ((size_t)top + 63) / 64;
    uint64_t *free_map = PyMem_Calloc(words, sizeof(uint64_t));
    uint32_t *before = PyMem_Malloc(words * sizeof(uint32_t));
    if (free_map == NULL || before == NULL) {
        PyMem_Free(free_map);
        PyMem_Free(before);
        return;
    }
    for (uint32_t x = 1; x < top;) {
        uint32_t units = block_units(t, x);
        if (node_at(t, x)->link[1] & FREE_BIT) {
            for (uint32_t u = x; u < x + units; u++) {
                free_map[u >> 6] |= (uint64_t)1 << (u & 63);
            }
        }
        x += units;
    }
    uint32_t count = 0;
    for (size_t w = 0; w < words; w++) {
        before[w] = count;
        count += popcount64(free_map[w]);
    }
#define MOVED(x) ((x) - before[(x) >> 6] \
    - popcount64(free_map[(x) >> 6] & (((uint64_t)1 << ((x) & 63)) - 1)))
    for (uint32_t x = 1; x < top;) {
        Node *n = node_at(t, x);
        if (n->link[1] & FREE_BIT) {
            x += n->link[1] & INDEX_MASK;
            continue;
        }
        uint32_t units = node_units(n);
        uint32_t left = n->link[0] & INDEX_MASK, right = n->link[1];
        uint32_t colour = n->link[0] & RED_BIT;
        uint32_t to = MOVED(x);
        if (to != x) {
            memmove(node_at(t, to), n, (size_t)units << UNIT_SHIFT);
        }
        Node *moved = node_at(t, to);
        moved->link[0] = colour | (left ? MOVED(left) : 0);
        moved->link[1] = right ? MOVED(right) : 0;
        x += units;
    }
    t->root = t->root ? MOVED(t->root) : 0;
#undef MOVED
    PyMem_Free(free_map);
    PyMem_Free(before);
    t->top = top - count;
    t->free_units = 0;
    PyMem_Free(t->free_heads);
    t->free_heads = NULL;
    t->free_classes = 0;
    arena_shrink(t, arena_size_for((size_t)t->top << UNIT_SHIFT));
    t->layout++;
    t->compactions++;
}

/* After blocks were freed: give an empty tree's arena back, compact one
 * whose free units passed a quarter of those in use. */
static void
after_free(TreeObject *t)
{
    if (t->size == 0) {
        arena_release(t);
        return;
    }
    if (((size_t)t->top << UNIT_SHIFT) >= COMPACT_MIN_BYTES
            && t->free_units * 4 > t->top) {
        tree_compact(t);
    }
}

/* ------------------------------------------------------------ operations */

/* Store (key, value).  1: new, 0: replaced, -1 with MemoryError and the
 * tree unchanged.  Sizes are within the limits (the caller checked). */
static int
tree_put(TreeObject *t, const unsigned char *key, size_t key_size,
         const unsigned char *value, size_t value_size)
{
    Path path;
    uint32_t units = record_units(key_size, value_size);
    uint32_t found = tree_locate(t, key, key_size, &path);
    if (found != 0) {
        if (node_units(node_at(t, found)) == units) {
            value_write(node_at(t, found), value, value_size);
            return 0;
        }
        uint32_t x = node_alloc(t, units);      /* may move the arena */
        if (x == 0) {
            return -1;
        }
        Node *old = node_at(t, found), *moved = node_at(t, x);
        uint32_t old_units = node_units(old);
        moved->link[0] = old->link[0];
        moved->link[1] = old->link[1];
        record_write(moved, key, key_size, value, value_size);
        int depth = path.depth;
        if (depth == 0) {
            t->root = x;
        }
        else {
            set_child(t, path.node[depth - 1], path.side[depth - 1], x);
        }
        node_free(t, found, old_units);
        t->layout++;
        after_free(t);
        return 0;
    }
    uint32_t x = node_alloc(t, units);
    if (x == 0) {
        return -1;
    }
    Node *n = node_at(t, x);
    n->link[0] = RED_BIT;
    n->link[1] = 0;
    record_write(n, key, key_size, value, value_size);
    int depth = path.depth;
    if (depth == 0) {
        t->root = x;
    }
    else {
        set_child(t, path.node[depth - 1], path.side[depth - 1], x);
    }
    path.node[depth] = x;
    insert_fixup(t, &path, depth);
    t->size++;
    t->version++;
    t->layout++;
    return 1;
}

/* Unlink and free the node at the end of `path`. */
static void
tree_remove_at(TreeObject *t, Path *path)
{
    uint32_t z = path->node[path->depth];
    uint32_t units = node_units(node_at(t, z));
    delete_at(t, path);
    node_free(t, z, units);
    t->size--;
    t->version++;
    t->layout++;
    after_free(t);
}

/* 1 if `key` was there and is removed, 0 if absent. */
static int
tree_remove(TreeObject *t, const unsigned char *key, size_t key_size)
{
    Path path;
    if (tree_locate(t, key, key_size, &path) == 0) {
        return 0;
    }
    tree_remove_at(t, &path);
    return 1;
}

static void
tree_clear(TreeObject *t)
{
    if (t->size != 0) {
        t->version++;
        t->layout++;
    }
    arena_release(t);
}

/* What the allocator holds: a mapping's pages up to the top, a smaller
 * arena's whole block, and the free-list heads. */
static size_t
tree_bytes_held(const TreeObject *t)
{
    size_t arena = t->mapped ? round_up((size_t)t->top << UNIT_SHIFT, page_size)
                             : t->capacity;
    return arena + (size_t)t->free_classes * sizeof(uint32_t);
}

/* ------------------------------------------------------------ arguments */

static int
check_key(PyObject *key)
{
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "RecordTree keys must be bytes, not %.100s",
                     Py_TYPE(key)->tp_name);
        return -1;
    }
    return 0;
}

/* The limits of the record format (the protocol's are lower). */
static int
check_sizes(Py_ssize_t key_size, Py_ssize_t value_size)
{
    if (key_size > MAX_KEY_BYTES) {
        PyErr_Format(KeyTooLarge, "key of %zd bytes is over the RecordTree's "
                     "%u-byte limit", key_size, (unsigned)MAX_KEY_BYTES);
        return -1;
    }
    if ((uint64_t)value_size > MAX_VALUE_BYTES) {
        PyErr_Format(ValueTooLarge, "value of %zd bytes is over the "
                     "RecordTree's %lu-byte limit", value_size,
                     (unsigned long)MAX_VALUE_BYTES);
        return -1;
    }
    return 0;
}

static int
put_object(TreeObject *t, PyObject *key, PyObject *value)
{
    if (check_key(key) < 0) {
        return -1;
    }
    if (!PyBytes_Check(value)) {
        PyErr_Format(PyExc_TypeError,
                     "RecordTree values must be bytes, not %.100s",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    Py_ssize_t key_size = PyBytes_GET_SIZE(key);
    Py_ssize_t value_size = PyBytes_GET_SIZE(value);
    if (check_sizes(key_size, value_size) < 0) {
        return -1;
    }
    return tree_put(t, (const unsigned char *)PyBytes_AS_STRING(key),
                    (size_t)key_size,
                    (const unsigned char *)PyBytes_AS_STRING(value),
                    (size_t)value_size);
}

/* The node of a key object: -1 (not bytes), else its node or 0. */
static int
find_object(TreeObject *t, PyObject *key, uint32_t *found)
{
    if (check_key(key) < 0) {
        return -1;
    }
    *found = tree_find(t, (const unsigned char *)PyBytes_AS_STRING(key),
                       (size_t)PyBytes_GET_SIZE(key));
    return 0;
}

static PyObject *
node_key(const TreeObject *t, uint32_t x)
{
    const Node *n = node_at(t, x);
    return PyBytes_FromStringAndSize((const char *)n->key,
                                     (Py_ssize_t)key_length(n));
}

static PyObject *
node_value(const TreeObject *t, uint32_t x)
{
    const Node *n = node_at(t, x);
    return PyBytes_FromStringAndSize((const char *)value_bytes(n),
                                     (Py_ssize_t)value_length(n));
}

static PyObject *
node_item(const TreeObject *t, uint32_t x)
{
    PyObject *key = node_key(t, x);
    PyObject *value = key ? node_value(t, x) : NULL;
    if (value == NULL) {
        Py_XDECREF(key);
        return NULL;
    }
    PyObject *item = PyTuple_Pack(2, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
    return item;
}

static void
set_key_error(PyObject *key)
{
    PyObject *args = PyTuple_Pack(1, key);
    if (args != NULL) {
        PyErr_SetObject(PyExc_KeyError, args);
        Py_DECREF(args);
    }
}

/* ------------------------------------------------------------ iterator */

typedef struct {
    PyObject_HEAD
    TreeObject *tree;       /* NULL once exhausted */
    uint64_t version;
    uint64_t layout;        /* the tree's when the walk was last placed */
    int mode;
    int reverse;
    int placed;             /* the walk has been placed (first step taken) */
    PyObject *start;        /* bound to start from (owned bytes) or NULL */
    int start_inclusive;
    PyObject *stop;         /* bound to stop at (owned bytes) or NULL */
    int stop_inclusive;
    PyObject *last;         /* the last key returned (owned) or NULL */
    Walk walk;
} IterObject;

static PyObject *
iter_new(TreeObject *t, PyObject *low, PyObject *high, int low_inclusive,
         int high_inclusive, int reverse, int mode)
{
    IterObject *it = PyObject_GC_New(IterObject, &Iter_Type);
    if (it == NULL) {
        return NULL;
    }
    it->tree = (TreeObject *)Py_NewRef(t);
    it->version = t->version;
    it->layout = t->layout;
    it->mode = mode;
    it->reverse = reverse;
    it->placed = 0;
    it->start = Py_XNewRef(reverse ? high : low);
    it->start_inclusive = reverse ? high_inclusive : low_inclusive;
    it->stop = Py_XNewRef(reverse ? low : high);
    it->stop_inclusive = reverse ? low_inclusive : high_inclusive;
    it->last = NULL;
    it->walk.depth = 0;
    PyObject_GC_Track(it);
    return (PyObject *)it;
}

static int
iter_traverse(IterObject *it, visitproc visit, void *arg)
{
    Py_VISIT(it->tree);
    return 0;
}

static void
iter_exhaust(IterObject *it)
{
    Py_CLEAR(it->tree);
    Py_CLEAR(it->start);
    Py_CLEAR(it->stop);
    Py_CLEAR(it->last);
}

static int
iter_clear(IterObject *it)
{
    iter_exhaust(it);
    return 0;
}

static void
iter_dealloc(IterObject *it)
{
    PyObject_GC_UnTrack(it);
    iter_exhaust(it);
    PyObject_GC_Del(it);
}

/* Place the walk: after the last key returned, or at the start bound. */
static void
iter_place(IterObject *it)
{
    TreeObject *t = it->tree;
    PyObject *from = it->last;
    int which;
    if (from != NULL) {
        which = it->reverse ? BOUND_LOWER : BOUND_HIGHER;
    }
    else {
        from = it->start;
        if (from == NULL) {
            walk_start(t, &it->walk, it->reverse);
            goto placed;
        }
        which = it->reverse ? (it->start_inclusive ? BOUND_FLOOR : BOUND_LOWER)
                            : (it->start_inclusive ? BOUND_CEIL : BOUND_HIGHER);
    }
    walk_from(t, &it->walk, (const unsigned char *)PyBytes_AS_STRING(from),
              (size_t)PyBytes_GET_SIZE(from), which);
placed:
    it->placed = 1;
    it->layout = t->layout;
}

static PyObject *
iter_next(IterObject *it)
{
    TreeObject *t = it->tree;
    if (t == NULL) {
        return NULL;
    }
    if (t->version != it->version) {
        iter_exhaust(it);
        PyErr_SetString(PyExc_RuntimeError, ITER_CHANGED);
        return NULL;
    }
    if (!it->placed || t->layout != it->layout) {
        iter_place(it);
    }
    uint32_t x = walk_next(t, &it->walk, it->reverse);
    if (x != 0 && it->stop != NULL) {
        const Node *n = node_at(t, x);
        int c = compare_keys(n->key, key_length(n),
                             (const unsigned char *)PyBytes_AS_STRING(it->stop),
                             (size_t)PyBytes_GET_SIZE(it->stop));
        if (it->reverse) {
            c = -c;
        }
        if (c > 0 || (c == 0 && !it->stop_inclusive)) {
            x = 0;
        }
    }
    if (x == 0) {
        iter_exhaust(it);
        return NULL;
    }
    PyObject *key = node_key(t, x);
    if (key == NULL) {
        return NULL;
    }
    PyObject *result;
    if (it->mode == MODE_KEYS) {
        result = Py_NewRef(key);
    }
    else {
        PyObject *value = node_value(t, x);
        if (value == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        result = it->mode == MODE_VALUES ? Py_NewRef(value)
                                         : PyTuple_Pack(2, key, value);
        Py_DECREF(value);
    }
    if (result == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    Py_XSETREF(it->last, key);
    return result;
}

static PyTypeObject Iter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._recordtree.RecordTreeIterator",
    .tp_basicsize = sizeof(IterObject),
    .tp_dealloc = (destructor)iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)iter_traverse,
    .tp_clear = (inquiry)iter_clear,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)iter_next,
};

/* ------------------------------------------------------------ the type */

static int
Tree_init(TreeObject *t, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "RecordTree() takes no arguments");
        return -1;
    }
    tree_clear(t);
    return 0;
}

static void
Tree_dealloc(TreeObject *t)
{
    arena_release(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
Tree_length(TreeObject *t)
{
    return t->size;
}

static int
Tree_contains(TreeObject *t, PyObject *key)
{
    uint32_t x;
    if (find_object(t, key, &x) < 0) {
        return -1;
    }
    return x != 0;
}

static PyObject *
Tree_subscript(TreeObject *t, PyObject *key)
{
    uint32_t x;
    if (find_object(t, key, &x) < 0) {
        return NULL;
    }
    if (x == 0) {
        set_key_error(key);
        return NULL;
    }
    return node_value(t, x);
}

static int
Tree_ass_subscript(TreeObject *t, PyObject *key, PyObject *value)
{
    if (value != NULL) {
        return put_object(t, key, value) < 0 ? -1 : 0;
    }
    if (check_key(key) < 0) {
        return -1;
    }
    if (!tree_remove(t, (const unsigned char *)PyBytes_AS_STRING(key),
                     (size_t)PyBytes_GET_SIZE(key))) {
        set_key_error(key);
        return -1;
    }
    return 0;
}

static PyObject *
Tree_iter(TreeObject *t)
{
    return iter_new(t, NULL, NULL, 1, 1, 0, MODE_KEYS);
}

static PyObject *
Tree_reversed(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    return iter_new(t, NULL, NULL, 1, 1, 1, MODE_KEYS);
}

static int
check_arity(const char *name, Py_ssize_t nargs, Py_ssize_t low,
            Py_ssize_t high)
{
    if (nargs < low || nargs > high) {
        if (low == high) {
            PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd argument%s "
                         "(%zd given)", name, low, low == 1 ? "" : "s", nargs);
        }
        else {
            PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd "
                         "arguments (%zd given)", name, low, high, nargs);
        }
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(Tree_get_doc,
"get($self, key, default=None, /)\n--\n\n"
"The value of `key`, or `default` if it is absent.");

static PyObject *
Tree_get(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_arity("get", nargs, 1, 2) < 0) {
        return NULL;
    }
    uint32_t x;
    if (find_object(t, args[0], &x) < 0) {
        return NULL;
    }
    if (x == 0) {
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    }
    return node_value(t, x);
}

PyDoc_STRVAR(Tree_put_doc,
"put($self, key, value, /)\n--\n\n"
"Store `value` under `key`; True if the key was new.");

static PyObject *
Tree_put(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_arity("put", nargs, 2, 2) < 0) {
        return NULL;
    }
    int created = put_object(t, args[0], args[1]);
    if (created < 0) {
        return NULL;
    }
    return PyBool_FromLong(created);
}

PyDoc_STRVAR(Tree_delete_doc,
"delete($self, key, /)\n--\n\n"
"Remove `key`; True if it was there.");

static PyObject *
Tree_delete(TreeObject *t, PyObject *key)
{
    if (check_key(key) < 0) {
        return NULL;
    }
    return PyBool_FromLong(tree_remove(
        t, (const unsigned char *)PyBytes_AS_STRING(key),
        (size_t)PyBytes_GET_SIZE(key)));
}

PyDoc_STRVAR(Tree_contains_doc,
"contains($self, key, /)\n--\n\n"
"Whether `key` is present (`key in tree`).");

static PyObject *
Tree_contains_method(TreeObject *t, PyObject *key)
{
    int present = Tree_contains(t, key);
    if (present < 0) {
        return NULL;
    }
    return PyBool_FromLong(present);
}

PyDoc_STRVAR(Tree_pop_doc,
"pop($self, key, default=<unrepresentable>, /)\n--\n\n"
"Remove `key` and return its value; `default` (or KeyError) if absent.");

static PyObject *
Tree_pop(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_arity("pop", nargs, 1, 2) < 0) {
        return NULL;
    }
    PyObject *key = args[0];
    if (check_key(key) < 0) {
        return NULL;
    }
    Path path;
    uint32_t x = tree_locate(t, (const unsigned char *)PyBytes_AS_STRING(key),
                             (size_t)PyBytes_GET_SIZE(key), &path);
    if (x == 0) {
        if (nargs == 2) {
            return Py_NewRef(args[1]);
        }
        set_key_error(key);
        return NULL;
    }
    PyObject *value = node_value(t, x);
    if (value != NULL) {
        tree_remove_at(t, &path);
    }
    return value;
}

PyDoc_STRVAR(Tree_popitem_doc,
"popitem($self, /, last=True)\n--\n\n"
"Remove and return the (key, value) pair of the largest key (last=False:\n"
"the smallest); KeyError if the tree is empty.");

static PyObject *
Tree_popitem(TreeObject *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"last", NULL};
    int last = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:popitem", kwlist, &last)) {
        return NULL;
    }
    if (t->size == 0) {
        PyErr_SetString(PyExc_KeyError, "popitem(): RecordTree is empty");
        return NULL;
    }
    Path path;
    uint32_t x = t->root;
    int depth = 0;
    for (uint32_t next; (next = child(t, x, last)) != 0; x = next) {
        path.node[depth] = x;
        path.side[depth++] = (uint8_t)last;
    }
    path.node[depth] = x;
    path.depth = depth;
    PyObject *item = node_item(t, x);
    if (item != NULL) {
        tree_remove_at(t, &path);
    }
    return item;
}

PyDoc_STRVAR(Tree_clear_doc,
"clear($self, /)\n--\n\n"
"Remove every record and give the arena back.");

static PyObject *
Tree_clear_method(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    tree_clear(t);
    Py_RETURN_NONE;
}

/* A bound of irange: bytes, or None (NULL). */
static int
parse_bound(PyObject *bound, PyObject **out)
{
    if (bound == Py_None) {
        *out = NULL;
        return 0;
    }
    if (!PyBytes_Check(bound)) {
        PyErr_Format(PyExc_TypeError, "RecordTree bounds must be bytes or None, "
                     "not %.100s", Py_TYPE(bound)->tp_name);
        return -1;
    }
    *out = bound;
    return 0;
}

PyDoc_STRVAR(Tree_irange_doc,
"irange($self, /, low=None, high=None, *, inclusive=(True, True),\n"
"       reverse=False, items=False)\n--\n\n"
"Keys (or (key, value) pairs) from `low` to `high` (None: unbounded) in\n"
"bytewise order, descending if `reverse`; `inclusive` says whether each\n"
"bound belongs to the range.  O(log n) to start, O(1) amortized a step.");

static PyObject *
Tree_irange(TreeObject *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"low", "high", "inclusive", "reverse", "items",
                             NULL};
    PyObject *low = Py_None, *high = Py_None, *inclusive = NULL;
    int reverse = 0, items = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO$Opp:irange", kwlist, &low,
                                     &high, &inclusive, &reverse, &items)) {
        return NULL;
    }
    PyObject *lo, *hi;
    if (parse_bound(low, &lo) < 0 || parse_bound(high, &hi) < 0) {
        return NULL;
    }
    int low_inclusive = 1, high_inclusive = 1;
    if (inclusive != NULL) {
        if (!PyTuple_Check(inclusive) || PyTuple_GET_SIZE(inclusive) != 2) {
            PyErr_SetString(PyExc_TypeError, "inclusive must be a pair of "
                            "booleans, such as (True, False)");
            return NULL;
        }
        low_inclusive = PyObject_IsTrue(PyTuple_GET_ITEM(inclusive, 0));
        if (low_inclusive < 0) {
            return NULL;
        }
        high_inclusive = PyObject_IsTrue(PyTuple_GET_ITEM(inclusive, 1));
        if (high_inclusive < 0) {
            return NULL;
        }
    }
    return iter_new(t, lo, hi, low_inclusive, high_inclusive, reverse,
                    items ? MODE_ITEMS : MODE_KEYS);
}

PyDoc_STRVAR(Tree_values_iter_doc,
"_values($self, /, *, reverse=False)\n--\n\n"
"An iterator over the values in key order (descending if `reverse`).");

static PyObject *
Tree_values_iter(TreeObject *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"reverse", NULL};
    int reverse = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$p:_values", kwlist,
                                     &reverse)) {
        return NULL;
    }
    return iter_new(t, NULL, NULL, 1, 1, reverse, MODE_VALUES);
}

/* What _check marks the first unit of each block with. */
enum { BLOCK_LIVE = 1, BLOCK_FREE, BLOCK_IN_TREE, BLOCK_LISTED };

/* Check the subtree at x (keys strictly between lo and hi) and put its
 * black height in *height; -1 with AssertionError naming the broken
 * invariant.  Each node must start a live block of the arena (marked in
 * `map`), and is marked as seen. */
static int
check_subtree(const TreeObject *t, uint32_t x, const Node *lo, const Node *hi,
              unsigned char *map, Py_ssize_t *count, int depth, int *height)
{
    if (x == 0) {
        *height = 0;
        return 0;
    }
    if (depth >= MAX_DEPTH || x >= t->top || map[x] != BLOCK_LIVE) {
        PyErr_Format(PyExc_AssertionError, "RecordTree: node %u is not a live "
                     "block of the arena, or is in the tree twice, or too deep",
                     x);
        return -1;
    }
    map[x] = BLOCK_IN_TREE;
    const Node *n = node_at(t, x);
    size_t key_size = key_length(n);
    if (value_width(n) != width_for(value_length(n))) {
        PyErr_Format(PyExc_AssertionError, "RecordTree: node %u has a value "
                     "length in the wrong width", x);
        return -1;
    }
    if ((lo != NULL && compare_keys(lo->key, key_length(lo), n->key,
                                    key_size) >= 0)
            || (hi != NULL && compare_keys(n->key, key_size, hi->key,
                                           key_length(hi)) >= 0)) {
        PyErr_SetString(PyExc_AssertionError, "RecordTree: keys out of order");
        return -1;
    }
    uint32_t left = child(t, x, 0), right = child(t, x, 1);
    if (is_red(t, x) && (is_red(t, left) || is_red(t, right))) {
        PyErr_SetString(PyExc_AssertionError, "RecordTree: a red node has a "
                        "red child");
        return -1;
    }
    int left_height, right_height;
    if (check_subtree(t, left, lo, n, map, count, depth + 1, &left_height) < 0
            || check_subtree(t, right, n, hi, map, count, depth + 1,
                             &right_height) < 0) {
        return -1;
    }
    if (left_height != right_height) {
        PyErr_SetString(PyExc_AssertionError, "RecordTree: black heights "
                        "differ");
        return -1;
    }
    *height = left_height + !is_red(t, x);
    (*count)++;
    return 0;
}

PyDoc_STRVAR(Tree_check_doc,
"_check($self, /)\n--\n\n"
"Verify every invariant: the arena is a run of live and free blocks from\n"
"unit 1 to the top, the free ones adding up to the free-unit count; the\n"
"tree links every live block once, in key order, with the red-black\n"
"properties and the size; the free lists hold free blocks of their size,\n"
"once each.  AssertionError naming the first broken one.  O(arena units).");

static PyObject *
Tree_check(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    if (t->base == NULL) {
        if (t->size != 0 || t->top != 0 || t->root != 0 || t->free_units != 0
                || t->capacity != 0) {
            PyErr_SetString(PyExc_AssertionError, "RecordTree: no arena, but "
                            "records or units counted");
            return NULL;
        }
        Py_RETURN_NONE;
    }
    if (t->size == 0 || ((size_t)t->top << UNIT_SHIFT) > t->capacity) {
        PyErr_SetString(PyExc_AssertionError, "RecordTree: an arena for no "
                        "record, or a top past its end");
        return NULL;
    }
    unsigned char *map = PyMem_Calloc(t->top, 1);
    if (map == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    const Node *nil = node_at(t, 0);
    if (nil->link[0] != 0 || nil->link[1] != 0) {
        PyErr_SetString(PyExc_AssertionError, "RecordTree: the nil was written");
        goto done;
    }
    uint64_t free_units = 0;
    Py_ssize_t live = 0;
    for (uint32_t x = 1; x < t->top;) {
        int is_free = (node_at(t, x)->link[1] & FREE_BIT) != 0;
        uint32_t units = block_units(t, x);
        if (units == 0 || (uint64_t)x + units > t->top) {
            PyErr_Format(PyExc_AssertionError, "RecordTree: the block at unit "
                         "%u runs past the top", x);
            goto done;
        }
        map[x] = is_free ? BLOCK_FREE : BLOCK_LIVE;
        free_units += is_free ? units : 0;
        live += !is_free;
        x += units;
    }
    if (free_units != t->free_units || live != t->size) {
        PyErr_Format(PyExc_AssertionError, "RecordTree: the arena holds %zd "
                     "records and %llu free units; counted %zd and %llu", live,
                     (unsigned long long)free_units, t->size,
                     (unsigned long long)t->free_units);
        goto done;
    }
    if (is_red(t, t->root)) {
        PyErr_SetString(PyExc_AssertionError, "RecordTree: the root is red");
        goto done;
    }
    Py_ssize_t count = 0;
    int height;
    if (check_subtree(t, t->root, NULL, NULL, map, &count, 0, &height) < 0) {
        goto done;
    }
    if (count != t->size) {
        PyErr_Format(PyExc_AssertionError, "RecordTree: %zd nodes, size %zd",
                     count, t->size);
        goto done;
    }
    for (uint32_t units = 0; units < t->free_classes; units++) {
        for (uint32_t x = t->free_heads[units]; x != 0;
                x = node_at(t, x)->link[0]) {
            if (units == 0 || x >= t->top || map[x] != BLOCK_FREE
                    || node_at(t, x)->link[1] != (FREE_BIT | units)) {
                PyErr_Format(PyExc_AssertionError, "RecordTree: block %u on "
                             "the free list of %u units is not such a free "
                             "block, or is listed twice", x, units);
                goto done;
            }
            map[x] = BLOCK_LISTED;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(map);
    return result;
}

PyDoc_STRVAR(Tree_stats_doc,
"_stats($self, /)\n--\n\n"
"The allocator's counts: records, arena capacity and whether it is a\n"
"mapping, used and free bytes, free-list classes, compactions, bytes held.");

static PyObject *
Tree_stats(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue(
        "{s:n,s:n,s:O,s:K,s:K,s:I,s:K,s:n}",
        "records", t->size,
        "capacity", (Py_ssize_t)t->capacity,
        "mapped", t->mapped ? Py_True : Py_False,
        "used_bytes", (unsigned long long)t->top << UNIT_SHIFT,
        "free_bytes", (unsigned long long)t->free_units << UNIT_SHIFT,
        "free_classes", (unsigned int)t->free_classes,
        "compactions", (unsigned long long)t->compactions,
        "bytes_held", (Py_ssize_t)tree_bytes_held(t));
}

PyDoc_STRVAR(Tree_reduce_doc,
"__reduce__($self, /)\n--\n\n"
"Pickling and copying: a new tree of the same type, the instance's\n"
"__dict__ if it has one, then every record.");

static PyObject *
Tree_reduce(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *state = PyObject_GetAttrString((PyObject *)t, "__dict__");
    if (state == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return NULL;
        }
        PyErr_Clear();
    }
    if (state == NULL || (PyDict_Check(state) && PyDict_GET_SIZE(state) == 0)) {
        Py_XSETREF(state, Py_NewRef(Py_None));
    }
    PyObject *items = iter_new(t, NULL, NULL, 1, 1, 0, MODE_ITEMS);
    if (items == NULL) {
        Py_DECREF(state);
        return NULL;
    }
    PyObject *result = Py_BuildValue("(O()OOO)", (PyObject *)Py_TYPE(t), state,
                                     Py_None, items);
    Py_DECREF(state);
    Py_DECREF(items);
    return result;
}

static PyObject *
Tree_sizeof(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t((size_t)Py_TYPE(t)->tp_basicsize
                             + tree_bytes_held(t));
}

static PyObject *
Tree_get_bytes_held(TreeObject *t, void *closure)
{
    return PyLong_FromSize_t(tree_bytes_held(t));
}

static PyMethodDef Tree_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Tree_get, METH_FASTCALL,
     Tree_get_doc},
    {"put", (PyCFunction)(void (*)(void))Tree_put, METH_FASTCALL,
     Tree_put_doc},
    {"delete", (PyCFunction)Tree_delete, METH_O, Tree_delete_doc},
    {"contains", (PyCFunction)Tree_contains_method, METH_O,
     Tree_contains_doc},
    {"pop", (PyCFunction)(void (*)(void))Tree_pop, METH_FASTCALL,
     Tree_pop_doc},
    {"popitem", (PyCFunction)(void (*)(void))Tree_popitem,
     METH_VARARGS | METH_KEYWORDS, Tree_popitem_doc},
    {"clear", (PyCFunction)Tree_clear_method, METH_NOARGS, Tree_clear_doc},
    {"irange", (PyCFunction)(void (*)(void))Tree_irange,
     METH_VARARGS | METH_KEYWORDS, Tree_irange_doc},
    {"_values", (PyCFunction)(void (*)(void))Tree_values_iter,
     METH_VARARGS | METH_KEYWORDS, Tree_values_iter_doc},
    {"__reversed__", (PyCFunction)Tree_reversed, METH_NOARGS, NULL},
    {"__sizeof__", (PyCFunction)Tree_sizeof, METH_NOARGS, NULL},
    {"__reduce__", (PyCFunction)Tree_reduce, METH_NOARGS, Tree_reduce_doc},
    {"_check", (PyCFunction)Tree_check, METH_NOARGS, Tree_check_doc},
    {"_stats", (PyCFunction)Tree_stats, METH_NOARGS, Tree_stats_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Tree_getset[] = {
    {"bytes_held", (getter)Tree_get_bytes_held, NULL,
     "bytes the tree's allocator holds for its records (arena and free "
     "lists)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods Tree_as_mapping = {
    .mp_length = (lenfunc)Tree_length,
    .mp_subscript = (binaryfunc)Tree_subscript,
    .mp_ass_subscript = (objobjargproc)Tree_ass_subscript,
};

static PySequenceMethods Tree_as_sequence = {
    .sq_contains = (objobjproc)Tree_contains,
};

PyDoc_STRVAR(Tree_doc,
"RecordTree()\n\n"
"Bytes keys to bytes values, in bytewise key order, every record kept in\n"
"one arena of the tree's own (see cext/recordtree.c).  The core of the\n"
"domus-rbt repository; domus.storage.recordtree.RecordTree is its\n"
"pure-Python twin.");

static PyTypeObject Tree_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._recordtree.RecordTree",
    .tp_basicsize = sizeof(TreeObject),
    .tp_dealloc = (destructor)Tree_dealloc,
    .tp_as_sequence = &Tree_as_sequence,
    .tp_as_mapping = &Tree_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = Tree_doc,
    .tp_iter = (getiterfunc)Tree_iter,
    .tp_methods = Tree_methods,
    .tp_getset = Tree_getset,
    .tp_init = (initproc)Tree_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------ the C API */

static int
api_find(PyObject *tree, const char *key, Py_ssize_t key_size,
         const char **value, Py_ssize_t *value_size)
{
    TreeObject *t = (TreeObject *)tree;
    uint32_t x = tree_find(t, (const unsigned char *)key, (size_t)key_size);
    if (x == 0) {
        return 0;
    }
    const Node *n = node_at(t, x);
    if (value != NULL) {
        *value = (const char *)value_bytes(n);
    }
    if (value_size != NULL) {
        *value_size = (Py_ssize_t)value_length(n);
    }
    return 1;
}

static int
api_put(PyObject *tree, const char *key, Py_ssize_t key_size,
        const char *value, Py_ssize_t value_size)
{
    if (key_size < 0 || value_size < 0) {
        PyErr_SetString(PyExc_ValueError, "negative size");
        return -1;
    }
    if (check_sizes(key_size, value_size) < 0) {
        return -1;
    }
    return tree_put((TreeObject *)tree, (const unsigned char *)key,
                    (size_t)key_size, (const unsigned char *)value,
                    (size_t)value_size);
}

static int
api_remove(PyObject *tree, const char *key, Py_ssize_t key_size)
{
    return tree_remove((TreeObject *)tree, (const unsigned char *)key,
                       (size_t)key_size);
}

static Py_ssize_t
api_size(PyObject *tree)
{
    return ((TreeObject *)tree)->size;
}

/* The descents of up to DOMUS_RECORDTREE_PREFETCH keys, in lock step: a
 * round compares each walk's key with its current node (which the round
 * before prefetched) and prefetches the child it goes to next, so the
 * memory accesses of all the walks are in flight together. */
static void
api_prefetch(PyObject *const *trees, const char *const *keys,
             const Py_ssize_t *key_sizes, Py_ssize_t count)
{
    uint32_t at[DOMUS_RECORDTREE_PREFETCH];
    if (count > DOMUS_RECORDTREE_PREFETCH) {
        count = DOMUS_RECORDTREE_PREFETCH;
    }
    int walking = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const TreeObject *t = (const TreeObject *)trees[i];
        at[i] = t->size != 0 ? t->root : 0;
        walking += at[i] != 0;
    }
    while (walking) {
        walking = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (at[i] == 0) {
                continue;
            }
            const TreeObject *t = (const TreeObject *)trees[i];
            const Node *n = node_at(t, at[i]);
            int c = compare_keys((const unsigned char *)keys[i],
                                 (size_t)key_sizes[i], n->key, key_length(n));
            uint32_t next = c == 0 ? 0 : n->link[c > 0] & INDEX_MASK;
            if (next != 0) {
                __builtin_prefetch(node_at(t, next));
                walking = 1;
            }
            at[i] = next;
        }
    }
}

static DomusRecordTreeAPI c_api = {
    .type = &Tree_Type,
    .find = api_find,
    .put = api_put,
    .remove = api_remove,
    .size = api_size,
    .prefetch = api_prefetch,
};

/* ------------------------------------------------------------ the module */

static struct PyModuleDef recordtree_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "domus._recordtree",
    .m_doc = "RecordTree: a bucket's records as bytes in one arena "
             "(see domus.storage.recordtree for its pure-Python twin).",
    .m_size = -1,
};

static int
add_size(PyObject *module, const char *name, size_t value)
{
    PyObject *number = PyLong_FromSize_t(value);
    if (number == NULL) {
        return -1;
    }
    int result = PyModule_AddObjectRef(module, name, number);
    Py_DECREF(number);
    return result;
}

PyMODINIT_FUNC
PyInit__recordtree(void)
{
    long page = sysconf(_SC_PAGESIZE);
    page_size = page > 0 ? (size_t)page : 4096;
    if (PyType_Ready(&Tree_Type) < 0 || PyType_Ready(&Iter_Type) < 0) {
        return NULL;
    }
    if (KeyTooLarge == NULL) {
        PyObject *errors = PyImport_ImportModule("domus.errors");
        if (errors == NULL) {
            return NULL;
        }
        KeyTooLarge = PyObject_GetAttrString(errors, "KeyTooLarge");
        ValueTooLarge = PyObject_GetAttrString(errors, "ValueTooLarge");
        Py_DECREF(errors);
        if (KeyTooLarge == NULL || ValueTooLarge == NULL) {
            Py_CLEAR(KeyTooLarge);
            Py_CLEAR(ValueTooLarge);
            return NULL;
        }
    }
    PyObject *module = PyModule_Create(&recordtree_module);
    if (module == NULL) {
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(&c_api, DOMUS_RECORDTREE_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(module, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "UNIT", UNIT) < 0
            || PyModule_AddIntConstant(module, "HEADER_BYTES",
                                       (long)HEADER_BYTES) < 0
            || PyModule_AddIntConstant(module, "LISTED_UNITS", LISTED_UNITS) < 0
            || PyModule_AddIntConstant(module, "MIN_CAPACITY", MIN_CAPACITY) < 0
            || PyModule_AddIntConstant(module, "MAP_THRESHOLD",
                                       MAP_THRESHOLD) < 0
            || PyModule_AddIntConstant(module, "COMPACT_MIN_BYTES",
                                       COMPACT_MIN_BYTES) < 0
            || PyModule_AddIntConstant(module, "MAX_KEY_BYTES",
                                       MAX_KEY_BYTES) < 0
            || add_size(module, "MAX_VALUE_BYTES", MAX_VALUE_BYTES) < 0
            || add_size(module, "MAX_ARENA_BYTES",
                        (size_t)(MAX_UNITS << UNIT_SHIFT)) < 0
            || add_size(module, "PAGE_SIZE", page_size) < 0
            || PyModule_AddType(module, &Tree_Type) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
