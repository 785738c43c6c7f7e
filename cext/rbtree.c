/* domus._rbtree: RBTree, an ordered mapping kept in a red-black tree.
 *
 * domus/rbtree/reference.py is the pure-Python reference: same names, same errors,
 * same messages and the same tree shapes (both make the case analysis of
 * CLRS, "Introduction to Algorithms", chapter 13).  tests/unit/test_rbtree.py
 * runs the two side by side on random operation sequences.
 *
 * Storage.  A tree owns two parallel arrays of slots: Node (16 bytes: the
 * order word and two 32-bit child indices, four to a cache line), which is
 * all a descent reads, and Cell (the key and value references), read once
 * the descent has found its node.  Slot 0 is a black nil.  There are no
 * parent links: insertion, deletion and iterators keep the path from the
 * root on a stack, which a red-black tree bounds to 2 log2(n + 1) < 64
 * levels.  The colour is bit 31 of the left link.  Freed slots are chained
 * through link[1] on a free list.  The arrays grow by doubling with
 * PyMem_Realloc, so a pointer into them is good only until the next
 * insertion: code that can run Python code between two uses of a slot keeps
 * its index and re-reads t->nodes.  The arrays are released when the tree
 * becomes empty.
 *
 * Kinds.  A tree holds keys of one kind, fixed by its first key and reset
 * when it is empty: "int" (int and subclasses), "bytes" (exact bytes) or
 * "object" (instances of the first key's type).  For int and bytes keys the
 * order word caches the key: the int64 value biased to uint64 (ints beyond
 * int64 saturate to 0 or UINT64_MAX), or the big-endian first 8 bytes.
 * Distinct words order their keys; only equal words (saturated ints, bytes
 * sharing 8 bytes) fall back to the key objects.  Object keys are compared
 * with `<` only, one comparison per level, exactly as the reference does.
 *
 * Reentrancy.  Comparing object keys and dropping references run Python
 * code, which may change the tree.  Two rules keep every path safe:
 *  - the structure is consistent whenever Python code can run: references
 *    are dropped only once linking or unlinking is complete, and references
 *    about to be handed out are taken before any Python object is allocated
 *    (an allocation can start the GC, and the GC runs finalizers);
 *  - `version` counts insertions, removals and clears.  A comparison of
 *    object keys checks it did not move before a search goes on (else
 *    RuntimeError), and iterators check it before each step.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "rbtree_api.h"

enum { KIND_NONE = 0, KIND_INT, KIND_BYTES, KIND_OBJECT };

#define RED_BIT 0x80000000u
#define INDEX_MASK 0x7FFFFFFFu
#define MAX_SLOTS ((size_t)INDEX_MASK)
#define MAX_DEPTH 96            /* > 2 log2(2^31) + 1, with room to spare */
#define INT_BIAS ((uint64_t)1 << 63)

typedef struct {
    uint64_t ord;       /* order word of int and bytes keys */
    uint32_t link[2];   /* left (with the colour bit), right; 0 is nil */
} Node;

typedef struct {
    PyObject *key;      /* NULL: a free slot */
    PyObject *value;
} Cell;

typedef struct {
    PyObject_HEAD
    Node *nodes;            /* NULL while the tree is empty */
    Cell *cells;            /* cells[i] belongs to nodes[i] */
    uint32_t root;
    uint32_t free_list;
    uint32_t used;          /* slots ever handed out, nil included */
    uint32_t capacity;
    Py_ssize_t size;
    uint64_t version;
    int kind;
    int keys_gc;            /* some key is a GC object: tp_traverse visits keys */
    PyTypeObject *key_type; /* object kind: the first key's type (owned) */
} TreeObject;

/* A key being looked for, with its order word computed once. */
typedef struct {
    PyObject *obj;  /* borrowed */
    uint64_t ord;
} Probe;

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
static PyTypeObject Keys_Type;
static PyTypeObject Values_Type;
static PyTypeObject Items_Type;
static PyObject *mapping_abc;   /* collections.abc.Mapping */

#define Tree_Check(op) PyObject_TypeCheck(op, &Tree_Type)

static const char ITER_CHANGED[] = "RBTree changed size during iteration";
static const char COMPARE_CHANGED[] = "RBTree changed during a key comparison";

static inline uint32_t
child(const Node *nodes, uint32_t x, int side)
{
    return nodes[x].link[side] & INDEX_MASK;
}

static inline void
set_child(Node *nodes, uint32_t x, int side, uint32_t y)
{
    nodes[x].link[side] = (nodes[x].link[side] & RED_BIT) | y;
}

static inline int
is_red(const Node *nodes, uint32_t x)
{
    return (int)(nodes[x].link[0] >> 31);
}

static inline void
set_red(Node *nodes, uint32_t x)
{
    nodes[x].link[0] |= RED_BIT;
}

static inline void
set_black(Node *nodes, uint32_t x)
{
    nodes[x].link[0] &= INDEX_MASK;
}


/* ------------------------------------------------------------ storage */

/* Ask for transparent huge pages on the 2 MiB-aligned interior of a large
 * array: a descent touches one node per level at random, and with 4 KiB
 * pages each would also miss the TLB.  Advisory only. */
static void
advise_huge_pages(void *start, size_t length)
{
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t first = ((uintptr_t)start + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)start + length) & ~(huge - 1);
    if (end > first) {
        (void)madvise((void *)first, end - first, MADV_HUGEPAGE);
    }
#else
    (void)start;
    (void)length;
#endif
}

/* A copy of `old` (used bytes of it) in a new block of `size` bytes; frees
 * `old`.  Large blocks are fresh memory advised for huge pages before the
 * copy touches them (realloc would keep the old small pages); small ones
 * are simply reallocated.  NULL with `old` untouched if out of memory. */
static void *
storage_resize(void *old, size_t used, size_t size)
{
    if (size < ((size_t)4 << 20)) {
        return PyMem_Realloc(old, size);
    }
    void *block = PyMem_Malloc(size);
    if (block == NULL) {
        return NULL;
    }
    advise_huge_pages(block, size);
    if (old != NULL) {
        memcpy(block, old, used);
    }
    PyMem_Free(old);
    return block;
}

/* Double the slot arrays.  On failure (MemoryError) the tree is unchanged
 * apart from possibly larger arrays. */
static int
storage_grow(TreeObject *t)
{
    size_t old = t->capacity;
    size_t capacity = old < 8 ? 8 : old * 2;
    if (capacity > MAX_SLOTS) {
        capacity = MAX_SLOTS;
    }
    if (capacity <= old) {
        PyErr_SetString(PyExc_MemoryError, "RBTree cannot hold more items");
        return -1;
    }
    Node *nodes = storage_resize(t->nodes, t->used * sizeof(Node), capacity * sizeof(Node));
    if (nodes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->nodes = nodes;
    Cell *cells = storage_resize(t->cells, t->used * sizeof(Cell), capacity * sizeof(Cell));
    if (cells == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->cells = cells;
    t->capacity = (uint32_t)capacity;
    return 0;
}

/* A free slot (not linked, contents undefined), or 0 with MemoryError. */
static uint32_t
node_alloc(TreeObject *t)
{
    uint32_t x = t->free_list;
    if (x != 0) {
        t->free_list = t->nodes[x].link[1];
        return x;
    }
    if ((size_t)t->used + (t->used == 0) >= t->capacity) {
        if (storage_grow(t) < 0) {
            return 0;
        }
    }
    if (t->used == 0) {
        memset(&t->nodes[0], 0, sizeof(Node));
        memset(&t->cells[0], 0, sizeof(Cell));
        t->used = 1;
    }
    return t->used++;
}

static void
node_free(TreeObject *t, uint32_t x)
{
    t->nodes[x].ord = 0;
    t->nodes[x].link[0] = 0;
    t->nodes[x].link[1] = t->free_list;
    t->cells[x].key = NULL;
    t->cells[x].value = NULL;
    t->free_list = x;
}

/* Forget every slot (the caller owns what they referred to). */
static void
storage_detach(TreeObject *t)
{
    t->nodes = NULL;
    t->cells = NULL;
    t->root = 0;
    t->free_list = 0;
    t->used = 0;
    t->capacity = 0;
    t->size = 0;
}


/* ------------------------------------------------------------ kinds */

static int
key_kind(PyObject *key)
{
    if (PyLong_Check(key)) {
        return KIND_INT;
    }
    if (PyBytes_CheckExact(key)) {
        return KIND_BYTES;
    }
    return KIND_OBJECT;
}

/* "'int'", "'bytes'" or "'object' (typename)", for error messages. */
static PyObject *
kind_describe(int kind, PyTypeObject *type)
{
    if (kind == KIND_INT) {
        return PyUnicode_FromString("'int'");
    }
    if (kind == KIND_BYTES) {
        return PyUnicode_FromString("'bytes'");
    }
    PyObject *name = PyType_GetName(type);
    if (name == NULL) {
        return NULL;
    }
    PyObject *described = PyUnicode_FromFormat("'object' (%U)", name);
    Py_DECREF(name);
    return described;
}

/* Set the TypeError for a key of the wrong kind; returns -1. */
static int
kind_error(TreeObject *t, PyObject *key)
{
    PyObject *held = kind_describe(t->kind, t->key_type);
    if (held == NULL) {
        return -1;
    }
    PyObject *given = kind_describe(key_kind(key), Py_TYPE(key));
    if (given != NULL) {
        PyErr_Format(PyExc_TypeError,
                     "RBTree holds keys of kind %U; got a key of kind %U "
                     "(the first key fixes the kind until the tree is empty)",
                     held, given);
        Py_DECREF(given);
    }
    Py_DECREF(held);
    return -1;
}

static void
kind_adopt(TreeObject *t, PyObject *key)
{
    t->kind = key_kind(key);
    if (t->kind == KIND_OBJECT) {
        t->key_type = (PyTypeObject *)Py_NewRef(Py_TYPE(key));
    }
}

static inline uint64_t
bytes_prefix(const char *data, Py_ssize_t length)
{
    unsigned char word[8] = {0};
    memcpy(word, data, length < 8 ? (size_t)length : 8);
    uint64_t prefix = 0;
    for (int i = 0; i < 8; i++) {
        prefix = (prefix << 8) | word[i];
    }
    return prefix;
}

/* Fill a probe for `key`; the tree must have a kind.  -1 with TypeError if
 * the key is of another kind. */
static inline int
probe_init(TreeObject *t, PyObject *key, Probe *probe)
{
    probe->obj = key;
    probe->ord = 0;
    switch (t->kind) {
    case KIND_INT: {
        if (!PyLong_Check(key)) {
            return kind_error(t, key);
        }
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(key, &overflow);
        if (overflow != 0) {
            probe->ord = overflow > 0 ? UINT64_MAX : 0;
        }
        else if (value == -1 && PyErr_Occurred()) {
            return -1;
        }
        else {
            probe->ord = (uint64_t)value ^ INT_BIAS;
        }
        return 0;
    }
    case KIND_BYTES:
        if (!PyBytes_CheckExact(key)) {
            return kind_error(t, key);
        }
        probe->ord = bytes_prefix(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
        return 0;
    default:
        if (key_kind(key) != KIND_OBJECT || !PyObject_TypeCheck(key, t->key_type)) {
            return kind_error(t, key);
        }
        return 0;
    }
}


/* ------------------------------------------------------------ comparing */

/* Compare two ints by value, ignoring any __lt__ of int subclasses (the int
 * kind orders by value).  int's own comparison cannot fail. */
static int
long_compare(PyObject *a, PyObject *b)
{
    PyObject *less = PyLong_Type.tp_richcompare(a, b, Py_LT);
    if (less == NULL) {
        PyErr_Clear();
        return 0;
    }
    int is_less = less == Py_True;
    Py_DECREF(less);
    if (is_less) {
        return -1;
    }
    PyObject *more = PyLong_Type.tp_richcompare(a, b, Py_GT);
    if (more == NULL) {
        PyErr_Clear();
        return 0;
    }
    int is_more = more == Py_True;
    Py_DECREF(more);
    return is_more;
}

/* Three-way comparison of a probe with the key of slot x, whose order word
 * equals the probe's. */
static int
tie_compare(const TreeObject *t, const Probe *probe, uint32_t x)
{
    PyObject *key = t->cells[x].key;
    if (t->kind == KIND_INT) {
        if (probe->ord != 0 && probe->ord != UINT64_MAX) {
            return 0;   /* both fit in int64 */
        }
        return long_compare(probe->obj, key);
    }
    Py_ssize_t la = PyBytes_GET_SIZE(probe->obj), lb = PyBytes_GET_SIZE(key);
    int c = memcmp(PyBytes_AS_STRING(probe->obj), PyBytes_AS_STRING(key),
                   (size_t)(la < lb ? la : lb));
    if (c != 0) {
        return c < 0 ? -1 : 1;
    }
    return (la > lb) - (la < lb);
}

/* Three-way comparison of a probe with slot x, int and bytes kinds. */
static inline int
fast_compare(const TreeObject *t, const Probe *probe, uint32_t x)
{
    uint64_t ord = t->nodes[x].ord;
    if (probe->ord != ord) {
        return probe->ord < ord ? -1 : 1;
    }
    return tie_compare(t, probe, x);
}

/* a < b for object keys: 1, 0, or -1 with an exception set, including
 * RuntimeError if the comparison changed the tree (the caller must then
 * not touch any slot it found before). */
static int
object_less(TreeObject *t, PyObject *a, PyObject *b)
{
    uint64_t version = t->version;
    Py_INCREF(a);
    Py_INCREF(b);
    int less = PyObject_RichCompareBool(a, b, Py_LT);
    Py_DECREF(a);
    Py_DECREF(b);
    if (less >= 0 && t->version != version) {
        PyErr_SetString(PyExc_RuntimeError, COMPARE_CHANGED);
        return -1;
    }
    return less;
}


/* ------------------------------------------------------------ searching */

/* The slot holding a key equal to the probe's, or 0; -1 on error (object
 * kind only).  With a path, also the way down to it. */
static inline int
tree_find(TreeObject *t, const Probe *probe, uint32_t *found, Path *path)
{
    uint32_t x = t->root;
    int depth = 0;
    *found = 0;
    if (t->kind != KIND_OBJECT) {
        const Node *nodes = t->nodes;
        const uint64_t ord = probe->ord;
        while (x != 0) {
            int side;
            if (ord != nodes[x].ord) {
                side = ord > nodes[x].ord;
            }
            else {
                int c = tie_compare(t, probe, x);
                if (c == 0) {
                    *found = x;
                    break;
                }
                side = c > 0;
            }
            if (path != NULL) {
                path->node[depth] = x;
                path->side[depth] = (uint8_t)side;
            }
            depth++;
            x = nodes[x].link[side] & INDEX_MASK;
        }
        if (path != NULL) {
            path->node[depth] = x;
            path->depth = depth;
        }
        return 0;
    }
    /* Object keys: one `<` per level down to a leaf, then one more on the
     * last node that was not greater than the key. */
    uint32_t candidate = 0;
    int candidate_depth = 0;
    while (x != 0) {
        int less = object_less(t, probe->obj, t->cells[x].key);
        if (less < 0) {
            return -1;
        }
        if (path != NULL) {
            path->node[depth] = x;
            path->side[depth] = (uint8_t)!less;
        }
        if (!less) {
            candidate = x;
            candidate_depth = depth;
        }
        depth++;
        x = child(t->nodes, x, !less);
    }
    if (candidate != 0) {
        int less = object_less(t, t->cells[candidate].key, probe->obj);
        if (less < 0) {
            return -1;
        }
        if (!less) {
            *found = candidate;
            if (path != NULL) {
                path->depth = candidate_depth;
            }
        }
    }
    return 0;
}

/* Where the probe's key is or belongs: *found is the slot with an equal
 * key, or 0 and then path holds the way down to the empty link a new node
 * hangs on (path->node[path->depth - 1], side path->side[path->depth - 1]).
 * -1 on error.  Same descent, hence same comparisons, as tree_find. */
static int
tree_locate(TreeObject *t, const Probe *probe, uint32_t *found, Path *path)
{
    uint32_t x = t->root, candidate = 0;
    int depth = 0;
    *found = 0;
    if (t->kind != KIND_OBJECT) {
        while (x != 0) {
            int c = fast_compare(t, probe, x);
            if (c == 0) {
                *found = x;
                return 0;
            }
            path->node[depth] = x;
            path->side[depth] = (uint8_t)(c > 0);
            depth++;
            x = child(t->nodes, x, c > 0);
        }
        path->depth = depth;
        return 0;
    }
    while (x != 0) {
        int less = object_less(t, probe->obj, t->cells[x].key);
        if (less < 0) {
            return -1;
        }
        path->node[depth] = x;
        path->side[depth] = (uint8_t)!less;
        depth++;
        if (!less) {
            candidate = x;
        }
        x = child(t->nodes, x, !less);
    }
    if (candidate != 0) {
        int less = object_less(t, t->cells[candidate].key, probe->obj);
        if (less < 0) {
            return -1;
        }
        if (!less) {
            *found = candidate;
            return 0;
        }
    }
    path->depth = depth;
    return 0;
}

/* The slot with the smallest key >= (CEIL), > (HIGHER), or the largest key
 * <= (FLOOR), < (LOWER) the probe's; 0 if none, -1 on error.  With a walk,
 * also every node an iteration from there would visit next: the nodes the
 * descent passed on the iteration's side (ascending for CEIL and HIGHER),
 * the found one on top. */
static int
tree_bound(TreeObject *t, const Probe *probe, int which, uint32_t *out, Walk *walk)
{
    uint32_t x = t->root, candidate = 0;
    int ascending = which == BOUND_CEIL || which == BOUND_HIGHER;
    int depth = 0;
    if (t->kind != KIND_OBJECT && walk == NULL) {
        /* floor/ceiling without a walk: the side to go is computed rather
         * than branched on, as in tree_find, and the candidate kept with a
         * conditional move.  At 10^6 keys a descent waits on memory (one
         * node per level); this keeps the loop to the load, the compare and
         * the next index. */
        const Node *nodes = t->nodes;
        const uint64_t ord = probe->ord;
        const int exact_stops = which == BOUND_CEIL || which == BOUND_FLOOR;
        const int equal_right = which == BOUND_FLOOR || which == BOUND_HIGHER;
        while (x != 0) {
            const uint64_t node_ord = nodes[x].ord;
            int right;
            if (ord != node_ord) {
                right = ord > node_ord;
            }
            else {
                int c = tie_compare(t, probe, x);
                if (c == 0 && exact_stops) {
                    candidate = x;
                    break;
                }
                right = c > 0 || (c == 0 && equal_right);
            }
            /* ascending bounds take the nodes they pass going left */
            candidate = (right ^ ascending) ? x : candidate;
            x = nodes[x].link[right] & INDEX_MASK;
        }
    }
    else if (t->kind != KIND_OBJECT) {
        while (x != 0) {
            int c = fast_compare(t, probe, x);
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
                candidate = x;
                if (walk != NULL) {
                    walk->node[depth++] = x;
                }
                if (c == 0) {
                    break;
                }
            }
            /* from a taken node ascending bounds go left, descending right */
            x = child(t->nodes, x, take ? !ascending : ascending);
        }
    }
    else {
        /* With `<` only: ceiling and lower ask "node < key", higher and
         * floor "key < node". */
        int node_first = which == BOUND_CEIL || which == BOUND_LOWER;
        while (x != 0) {
            PyObject *key = t->cells[x].key;
            int less = node_first ? object_less(t, key, probe->obj)
                                  : object_less(t, probe->obj, key);
            if (less < 0) {
                return -1;
            }
            int take = (which == BOUND_LOWER || which == BOUND_HIGHER) ? less : !less;
            if (take) {
                candidate = x;
                if (walk != NULL) {
                    walk->node[depth++] = x;
                }
            }
            x = child(t->nodes, x, take ? !ascending : ascending);
        }
    }
    if (walk != NULL) {
        walk->depth = depth;
    }
    *out = candidate;
    return 0;
}

static inline uint32_t
subtree_extreme(const Node *nodes, uint32_t x, int side)
{
    if (x == 0) {
        return 0;
    }
    uint32_t next;
    while ((next = child(nodes, x, side)) != 0) {
        x = next;
    }
    return x;
}

/* Push x and its descendants on the side an iteration comes from. */
static inline void
walk_descend(const Node *nodes, Walk *walk, uint32_t x, int reverse)
{
    while (x != 0) {
        walk->node[walk->depth++] = x;
        x = child(nodes, x, reverse);
    }
}

static inline void
walk_start(const TreeObject *t, Walk *walk, int reverse)
{
    walk->depth = 0;
    if (t->size != 0) {
        walk_descend(t->nodes, walk, t->root, reverse);
    }
}

/* The next slot of an in-order walk (descending if reverse), or 0. */
static inline uint32_t
walk_next(const TreeObject *t, Walk *walk, int reverse)
{
    if (walk->depth == 0) {
        return 0;
    }
    uint32_t x = walk->node[--walk->depth];
    walk_descend(t->nodes, walk, child(t->nodes, x, !reverse), reverse);
    return x;
}


/* ------------------------------------------------------------ rebalancing */

/* Rotate around x, whose parent is `up` (0: x is the root): side 0 lifts
 * x's right child into x's place (a left rotation), side 1 its left. */
static void
rotate(TreeObject *t, uint32_t x, int side, uint32_t up)
{
    Node *nodes = t->nodes;
    uint32_t y = child(nodes, x, !side);
    set_child(nodes, x, !side, child(nodes, y, side));
    set_child(nodes, y, side, x);
    if (up == 0) {
        t->root = y;
    }
    else {
        set_child(nodes, up, child(nodes, up, 1) == x, y);
    }
}

/* Restore the red-black properties after linking the red node
 * path->node[i] (CLRS RB-INSERT-FIXUP, walking the path instead of parent
 * links). */
static void
insert_fixup(TreeObject *t, Path *path, int i)
{
    Node *nodes = t->nodes;
    uint32_t *node = path->node;
    /* A red parent is not the root, so the grandparent node[i - 2] exists. */
    while (i >= 2 && is_red(nodes, node[i - 1])) {
        uint32_t parent = node[i - 1], grand = node[i - 2];
        int side = path->side[i - 2];
        uint32_t uncle = child(nodes, grand, !side);
        if (is_red(nodes, uncle)) {
            set_black(nodes, parent);
            set_black(nodes, uncle);
            set_red(nodes, grand);
            i -= 2;
            continue;
        }
        if (path->side[i - 1] != side) {
            /* inner grandchild: lift it into its parent's place */
            rotate(t, parent, side, grand);
            parent = node[i];
        }
        set_black(nodes, parent);
        set_red(nodes, grand);
        rotate(t, grand, !side, i >= 3 ? node[i - 3] : 0);
        break;
    }
    set_black(nodes, t->root);
}

/* Restore the red-black properties after a black node was unlinked and
 * replaced by x, which sits below path->node[i - 1] on side
 * path->side[i - 1] (CLRS RB-DELETE-FIXUP, walking the path). */
static void
delete_fixup(TreeObject *t, Path *path, int i, uint32_t x)
{
    Node *nodes = t->nodes;
    uint32_t *node = path->node;
    while (i > 0 && !is_red(nodes, x)) {
        uint32_t parent = node[i - 1];
        int side = path->side[i - 1];
        uint32_t sibling = child(nodes, parent, !side);
        if (is_red(nodes, sibling)) {
            set_black(nodes, sibling);
            set_red(nodes, parent);
            rotate(t, parent, side, i >= 2 ? node[i - 2] : 0);
            /* the sibling took the parent's place: x is one level deeper */
            node[i - 1] = sibling;
            path->side[i - 1] = (uint8_t)side;
            node[i] = parent;
            path->side[i] = (uint8_t)side;
            i++;
            sibling = child(nodes, parent, !side);
        }
        if (!is_red(nodes, child(nodes, sibling, 0)) && !is_red(nodes, child(nodes, sibling, 1))) {
            set_red(nodes, sibling);
            x = parent;
            i--;
            continue;
        }
        if (!is_red(nodes, child(nodes, sibling, !side))) {
            set_black(nodes, child(nodes, sibling, side));
            set_red(nodes, sibling);
            rotate(t, sibling, !side, parent);
            sibling = child(nodes, parent, !side);
        }
        if (is_red(nodes, parent)) {
            set_red(nodes, sibling);
        }
        else {
            set_black(nodes, sibling);
        }
        set_black(nodes, parent);
        set_black(nodes, child(nodes, sibling, !side));
        rotate(t, parent, side, i >= 2 ? node[i - 2] : 0);
        x = t->root;
        break;
    }
    if (x != 0) {
        set_black(nodes, x);
    }
}

/* Unlink the node path->node[path->depth] and rebalance; returns the slot
 * that left the tree, whose cell then holds the removed key and value.  A
 * node with two children trades its key and value with its successor's
 * (CLRS moves the successor node instead: the resulting shapes are the
 * same). */
static uint32_t
delete_at(TreeObject *t, Path *path)
{
    Node *nodes = t->nodes;
    int i = path->depth;
    uint32_t z = path->node[i];
    if (child(nodes, z, 0) != 0 && child(nodes, z, 1) != 0) {
        path->side[i] = 1;
        uint32_t y = child(nodes, z, 1);
        path->node[++i] = y;
        for (uint32_t next; (next = child(nodes, y, 0)) != 0; y = next) {
            path->side[i] = 0;
            path->node[++i] = next;
        }
        uint64_t ord = nodes[z].ord;
        nodes[z].ord = nodes[y].ord;
        nodes[y].ord = ord;
        Cell cell = t->cells[z];
        t->cells[z] = t->cells[y];
        t->cells[y] = cell;
        z = y;
    }
    uint32_t x = child(nodes, z, 0) ? child(nodes, z, 0) : child(nodes, z, 1);
    if (i == 0) {
        t->root = x;
    }
    else {
        set_child(nodes, path->node[i - 1], path->side[i - 1], x);
    }
    if (!is_red(nodes, z)) {
        delete_fixup(t, path, i, x);
    }
    return z;
}


/* ------------------------------------------------------------ operations */

/* Release everything: the tree is empty (and consistent) before the first
 * reference is dropped, so whatever those drops run sees an empty tree. */
static void
tree_clear(TreeObject *t)
{
    Cell *cells = t->cells;
    uint32_t used = t->used;
    PyTypeObject *key_type = t->key_type;
    if (t->size != 0) {
        t->version++;
    }
    PyMem_Free(t->nodes);
    storage_detach(t);
    t->kind = KIND_NONE;
    t->keys_gc = 0;
    t->key_type = NULL;
    for (uint32_t x = 1; x < used; x++) {
        if (cells[x].key != NULL) {
            Py_DECREF(cells[x].key);
            Py_DECREF(cells[x].value);
        }
    }
    PyMem_Free(cells);
    Py_XDECREF(key_type);
}

/* Find `key`: *found is its slot or 0.  -1 with TypeError on a key of the
 * wrong kind (an empty tree has no kind: nothing is found). */
static inline int
tree_lookup(TreeObject *t, PyObject *key, uint32_t *found)
{
    Probe probe;
    *found = 0;
    if (t->size == 0) {
        return 0;
    }
    if (probe_init(t, key, &probe) < 0) {
        return -1;
    }
    return tree_find(t, &probe, found, NULL);
}

/* Insert (key, value), or if the key is present and `replace` is set,
 * replace its value.  Returns 1 if the key was new, 0 if present (*at is
 * then its slot), -1 on error with the tree unchanged. */
static int
tree_insert(TreeObject *t, PyObject *key, PyObject *value, int replace, uint32_t *at)
{
    Probe probe;
    Path path;
    uint32_t found;
    int adopted = t->kind == KIND_NONE;
    if (adopted) {
        kind_adopt(t, key);
    }
    if (probe_init(t, key, &probe) < 0) {
        goto fail;
    }
    if (tree_locate(t, &probe, &found, &path) < 0) {
        goto fail;
    }
    if (found != 0) {
        if (at != NULL) {
            *at = found;
        }
        if (replace) {
            PyObject *old = t->cells[found].value;
            t->cells[found].value = Py_NewRef(value);
            Py_DECREF(old);
        }
        return 0;
    }
    uint32_t x = node_alloc(t);
    if (x == 0) {
        goto fail;
    }
    Node *nodes = t->nodes;
    nodes[x].ord = probe.ord;
    nodes[x].link[0] = RED_BIT;
    nodes[x].link[1] = 0;
    t->cells[x].key = Py_NewRef(key);
    t->cells[x].value = Py_NewRef(value);
    if (PyObject_IS_GC(key)) {
        t->keys_gc = 1;
    }
    int depth = path.depth;
    if (depth == 0) {
        t->root = x;
    }
    else {
        set_child(nodes, path.node[depth - 1], path.side[depth - 1], x);
    }
    path.node[depth] = x;
    insert_fixup(t, &path, depth);
    t->size++;
    t->version++;
    if (at != NULL) {
        *at = x;
    }
    return 1;

fail:
    if (adopted) {
        /* nothing was inserted: the tree is empty again */
        t->kind = KIND_NONE;
        Py_CLEAR(t->key_type);
    }
    return -1;
}

/* Unlink the node at the end of the path and hand its key and value
 * references to the caller.  The tree is consistent when this returns (it
 * runs Python code only at its very end, once the tree became empty). */
static void
tree_remove(TreeObject *t, Path *path, PyObject **key, PyObject **value)
{
    uint32_t x = delete_at(t, path);
    *key = t->cells[x].key;
    *value = t->cells[x].value;
    node_free(t, x);
    t->size--;
    t->version++;
    if (t->size == 0) {
        PyTypeObject *key_type = t->key_type;
        PyMem_Free(t->nodes);
        PyMem_Free(t->cells);
        storage_detach(t);
        t->kind = KIND_NONE;
        t->keys_gc = 0;
        t->key_type = NULL;
        Py_XDECREF(key_type);
    }
}

/* Remove `key`: 1 and *value (a new reference, if value is not NULL) if it
 * was there, 0 if absent, -1 on error. */
static int
tree_discard(TreeObject *t, PyObject *key, PyObject **value)
{
    Probe probe;
    Path path;
    uint32_t x;
    if (t->size == 0) {
        return 0;
    }
    if (probe_init(t, key, &probe) < 0 || tree_find(t, &probe, &x, &path) < 0) {
        return -1;
    }
    if (x == 0) {
        return 0;
    }
    PyObject *old_key, *old_value;
    tree_remove(t, &path, &old_key, &old_value);
    Py_DECREF(old_key);
    if (value != NULL) {
        *value = old_value;
    }
    else {
        Py_DECREF(old_value);
    }
    return 1;
}

/* The path down to the smallest (side 0) or largest key; tree not empty. */
static void
path_to_extreme(const TreeObject *t, Path *path, int side)
{
    uint32_t x = t->root;
    int depth = 0;
    for (uint32_t next; (next = child(t->nodes, x, side)) != 0; x = next) {
        path->node[depth] = x;
        path->side[depth++] = (uint8_t)side;
    }
    path->node[depth] = x;
    path->depth = depth;
}

/* Make the empty tree dst a copy of src: same slots, same shape. */
static int
tree_clone(TreeObject *dst, TreeObject *src)
{
    if (src->size == 0) {
        return 0;
    }
    size_t used = src->used;
    Node *nodes = PyMem_Malloc(used * sizeof(Node));
    Cell *cells = PyMem_Malloc(used * sizeof(Cell));
    if (nodes == NULL || cells == NULL) {
        PyMem_Free(nodes);
        PyMem_Free(cells);
        PyErr_NoMemory();
        return -1;
    }
    advise_huge_pages(nodes, used * sizeof(Node));
    advise_huge_pages(cells, used * sizeof(Cell));
    memcpy(nodes, src->nodes, used * sizeof(Node));
    memcpy(cells, src->cells, used * sizeof(Cell));
    for (size_t x = 1; x < used; x++) {
        if (cells[x].key != NULL) {
            Py_INCREF(cells[x].key);
            Py_INCREF(cells[x].value);
        }
    }
    dst->nodes = nodes;
    dst->cells = cells;
    dst->root = src->root;
    dst->free_list = src->free_list;
    dst->used = src->used;
    dst->capacity = src->used;
    dst->size = src->size;
    dst->kind = src->kind;
    dst->keys_gc = src->keys_gc;
    Py_XINCREF(src->key_type);
    dst->key_type = src->key_type;
    dst->version++;
    return 0;
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

/* A new (key, value) tuple for slot x.  The references are taken before
 * the tuple is allocated (which may run Python code). */
static PyObject *
node_item(TreeObject *t, uint32_t x)
{
    PyObject *key = Py_NewRef(t->cells[x].key);
    PyObject *value = Py_NewRef(t->cells[x].value);
    PyObject *item = PyTuple_New(2);
    if (item == NULL) {
        Py_DECREF(key);
        Py_DECREF(value);
        return NULL;
    }
    PyTuple_SET_ITEM(item, 0, key);
    PyTuple_SET_ITEM(item, 1, value);
    return item;
}


/* ------------------------------------------------------------ iterator */

/* An iterator over keys, values or items in key order (or reversed),
 * optionally stopping at a bound.  It owns a reference to its tree until
 * it is exhausted, and checks the tree's version before each step, so it
 * never follows an index into a changed tree. */
typedef struct {
    PyObject_HEAD
    TreeObject *tree;       /* NULL once exhausted */
    uint64_t version;
    int mode;
    int reverse;
    int inclusive;          /* is the stop bound itself yielded */
    Probe stop;             /* stop.obj owned, or NULL: no bound */
    Walk walk;
} IterObject;

/* An iterator that goes on with `walk`, a walk of t at `version` (the
 * allocation may run Python code: if that changes the tree, the iterator
 * raises at its first step). */
static PyObject *
iter_new(TreeObject *t, const Walk *walk, uint64_t version, int mode, int reverse,
         PyObject *stop, const Probe *stop_probe, int inclusive)
{
    IterObject *it = PyObject_GC_New(IterObject, &Iter_Type);
    if (it == NULL) {
        return NULL;
    }
    it->tree = (TreeObject *)Py_NewRef(t);
    it->version = version;
    it->mode = mode;
    it->reverse = reverse;
    it->inclusive = inclusive;
    it->stop.obj = NULL;
    if (stop != NULL) {
        it->stop = *stop_probe;
        it->stop.obj = Py_NewRef(stop);
    }
    it->walk.depth = walk->depth;
    memcpy(it->walk.node, walk->node, (size_t)walk->depth * sizeof(walk->node[0]));
    PyObject_GC_Track(it);
    return (PyObject *)it;
}

/* An iterator over the whole tree. */
static PyObject *
tree_iter_mode(TreeObject *t, int mode, int reverse)
{
    Walk walk;
    walk_start(t, &walk, reverse);
    return iter_new(t, &walk, t->version, mode, reverse, NULL, NULL, 0);
}

static void
Iter_dealloc(IterObject *it)
{
    PyObject_GC_UnTrack(it);
    Py_XDECREF(it->tree);
    Py_XDECREF(it->stop.obj);
    PyObject_GC_Del(it);
}

static int
Iter_traverse(IterObject *it, visitproc visit, void *arg)
{
    Py_VISIT(it->tree);
    Py_VISIT(it->stop.obj);
    return 0;
}

/* Is slot x past the stop bound?  1, 0, or -1 on error. */
static int
iter_beyond(IterObject *it, uint32_t x)
{
    TreeObject *t = it->tree;
    if (t->kind != KIND_OBJECT) {
        int c = fast_compare(t, &it->stop, x);
        if (!it->reverse) {
            return it->inclusive ? c < 0 : c <= 0;
        }
        return it->inclusive ? c > 0 : c >= 0;
    }
    PyObject *key = t->cells[x].key;
    PyObject *stop = it->stop.obj;
    int less;
    if (!it->reverse) {
        if (it->inclusive) {
            return object_less(t, stop, key);
        }
        less = object_less(t, key, stop);
    }
    else {
        if (it->inclusive) {
            return object_less(t, key, stop);
        }
        less = object_less(t, stop, key);
    }
    return less < 0 ? -1 : !less;
}

static PyObject *
Iter_next(IterObject *it)
{
    TreeObject *t = it->tree;
    if (t == NULL) {
        return NULL;
    }
    if (t->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, ITER_CHANGED);
        return NULL;
    }
    if (it->walk.depth == 0) {
        goto exhausted;
    }
    uint32_t x = it->walk.node[it->walk.depth - 1];
    if (it->stop.obj != NULL) {
        int beyond = iter_beyond(it, x);
        if (beyond < 0) {
            return NULL;
        }
        if (beyond) {
            goto exhausted;
        }
    }
    walk_next(t, &it->walk, it->reverse);
    switch (it->mode) {
    case MODE_KEYS:
        return Py_NewRef(t->cells[x].key);
    case MODE_VALUES:
        return Py_NewRef(t->cells[x].value);
    default:
        return node_item(t, x);
    }

exhausted:
    it->tree = NULL;
    Py_DECREF(t);
    return NULL;
}

static PyTypeObject Iter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._rbtree.RBTreeIterator",
    .tp_basicsize = sizeof(IterObject),
    .tp_dealloc = (destructor)Iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("An iterator over an RBTree in key order.  It raises "
                        "RuntimeError once a key was inserted or removed."),
    .tp_traverse = (traverseproc)Iter_traverse,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Iter_next,
};


/* ------------------------------------------------------------ tree methods */

static PyObject *
Tree_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    return type->tp_alloc(type, 0);
}

static int
Tree_traverse(TreeObject *t, visitproc visit, void *arg)
{
    Py_VISIT(t->key_type);
    for (uint32_t x = 1; x < t->used; x++) {
        if (t->cells[x].key == NULL) {
            continue;
        }
        if (t->keys_gc) {
            Py_VISIT(t->cells[x].key);
        }
        Py_VISIT(t->cells[x].value);
    }
    return 0;
}

static int
Tree_tp_clear(TreeObject *t)
{
    tree_clear(t);
    return 0;
}

static void
Tree_dealloc(TreeObject *t)
{
    PyObject_GC_UnTrack(t);
    Py_TRASHCAN_BEGIN(t, Tree_dealloc)
    tree_clear(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
    Py_TRASHCAN_END
}

static Py_ssize_t
Tree_length(TreeObject *t)
{
    return t->size;
}

static PyObject *
Tree_subscript(TreeObject *t, PyObject *key)
{
    uint32_t x;
    if (tree_lookup(t, key, &x) < 0) {
        return NULL;
    }
    if (x == 0) {
        set_key_error(key);
        return NULL;
    }
    return Py_NewRef(t->cells[x].value);
}

static int
Tree_ass_subscript(TreeObject *t, PyObject *key, PyObject *value)
{
    if (value != NULL) {
        return tree_insert(t, key, value, 1, NULL) < 0 ? -1 : 0;
    }
    int removed = tree_discard(t, key, NULL);
    if (removed == 0) {
        set_key_error(key);
        return -1;
    }
    return removed < 0 ? -1 : 0;
}

static int
Tree_contains(TreeObject *t, PyObject *key)
{
    uint32_t x;
    if (tree_lookup(t, key, &x) < 0) {
        return -1;
    }
    return x != 0;
}

static PyObject *
Tree_iter(TreeObject *t)
{
    return tree_iter_mode(t, MODE_KEYS, 0);
}

static PyObject *
Tree_reversed(TreeObject *t, PyObject *unused)
{
    return tree_iter_mode(t, MODE_KEYS, 1);
}

static int
check_arity(const char *name, Py_ssize_t nargs, Py_ssize_t low, Py_ssize_t high)
{
    if (nargs < low || nargs > high) {
        if (low == high) {
            PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd argument%s (%zd given)",
                         name, low, low == 1 ? "" : "s", nargs);
        }
        else {
            PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd arguments (%zd given)",
                         name, low, high, nargs);
        }
        return -1;
    }
    return 0;
}

static PyObject *
Tree_get(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t x;
    if (check_arity("get", nargs, 1, 2) < 0 || tree_lookup(t, args[0], &x) < 0) {
        return NULL;
    }
    if (x != 0) {
        return Py_NewRef(t->cells[x].value);
    }
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

static PyObject *
Tree_pop(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *value;
    if (check_arity("pop", nargs, 1, 2) < 0) {
        return NULL;
    }
    int removed = tree_discard(t, args[0], &value);
    if (removed < 0) {
        return NULL;
    }
    if (removed) {
        return value;
    }
    if (nargs == 2) {
        return Py_NewRef(args[1]);
    }
    set_key_error(args[0]);
    return NULL;
}

static PyObject *
Tree_popitem(TreeObject *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"last", NULL};
    int last = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:popitem", kwlist, &last)) {
        return NULL;
    }
    if (t->size == 0) {
        goto empty;
    }
    /* Allocate first: a failure must not lose the item. */
    PyObject *item = PyTuple_New(2);
    if (item == NULL) {
        return NULL;
    }
    if (t->size == 0) {
        Py_DECREF(item);
        goto empty;
    }
    Path path;
    PyObject *key, *value;
    path_to_extreme(t, &path, last);
    tree_remove(t, &path, &key, &value);
    PyTuple_SET_ITEM(item, 0, key);
    PyTuple_SET_ITEM(item, 1, value);
    return item;

empty:
    PyErr_SetString(PyExc_KeyError, "popitem(): RBTree is empty");
    return NULL;
}

static PyObject *
Tree_setdefault(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t x;
    if (check_arity("setdefault", nargs, 1, 2) < 0) {
        return NULL;
    }
    PyObject *value = nargs == 2 ? args[1] : Py_None;
    if (tree_insert(t, args[0], value, 0, &x) < 0) {
        return NULL;
    }
    return Py_NewRef(t->cells[x].value);
}

/* update() from another RBTree, in its key order. */
static int
update_from_tree(TreeObject *t, TreeObject *other)
{
    if (other == t) {
        return 0;
    }
    if (t->size == 0) {
        return tree_clone(t, other);
    }
    uint64_t version = other->version;
    Walk walk;
    walk_start(other, &walk, 0);
    for (uint32_t x; (x = walk_next(other, &walk, 0)) != 0;) {
        PyObject *key = Py_NewRef(other->cells[x].key);
        PyObject *value = Py_NewRef(other->cells[x].value);
        int stored = tree_insert(t, key, value, 1, NULL);
        Py_DECREF(key);
        Py_DECREF(value);
        if (stored < 0) {
            return -1;
        }
        if (other->version != version) {
            PyErr_SetString(PyExc_RuntimeError, ITER_CHANGED);
            return -1;
        }
    }
    return 0;
}

static int
update_from_dict(TreeObject *t, PyObject *dict)
{
    Py_ssize_t position = 0, size = PyDict_GET_SIZE(dict);
    PyObject *key, *value;
    while (PyDict_Next(dict, &position, &key, &value)) {
        Py_INCREF(key);
        Py_INCREF(value);
        int stored = tree_insert(t, key, value, 1, NULL);
        Py_DECREF(key);
        Py_DECREF(value);
        if (stored < 0) {
            return -1;
        }
        if (PyDict_GET_SIZE(dict) != size) {
            PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
            return -1;
        }
    }
    return 0;
}

/* update() from an iterable of pairs, with dict's errors. */
static int
update_from_pairs(TreeObject *t, PyObject *pairs)
{
    PyObject *iterator = PyObject_GetIter(pairs);
    if (iterator == NULL) {
        return -1;
    }
    PyObject *item;
    Py_ssize_t index = 0;
    int status = 0;
    while (status == 0 && (item = PyIter_Next(iterator)) != NULL) {
        PyObject *pair = NULL;
        PyObject *item_iterator = PyObject_GetIter(item);
        if (item_iterator == NULL) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Format(PyExc_TypeError,
                             "cannot convert RBTree update sequence element #%zd "
                             "to a sequence", index);
            }
            status = -1;
        }
        else {
            pair = PySequence_Tuple(item_iterator);
            Py_DECREF(item_iterator);
            if (pair == NULL) {
                status = -1;
            }
            else if (PyTuple_GET_SIZE(pair) != 2) {
                PyErr_Format(PyExc_ValueError,
                             "RBTree update sequence element #%zd has length %zd; "
                             "2 is required", index, PyTuple_GET_SIZE(pair));
                status = -1;
            }
            else if (tree_insert(t, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1),
                                 1, NULL) < 0) {
                status = -1;
            }
        }
        Py_XDECREF(pair);
        Py_DECREF(item);
        index++;
    }
    Py_DECREF(iterator);
    if (status == 0 && PyErr_Occurred()) {
        status = -1;
    }
    return status;
}

/* update() from a mapping: other.keys() and other[key]. */
static int
update_from_keys(TreeObject *t, PyObject *other, PyObject *keys_method)
{
    PyObject *keys = PyObject_CallNoArgs(keys_method);
    if (keys == NULL) {
        return -1;
    }
    PyObject *iterator = PyObject_GetIter(keys);
    Py_DECREF(keys);
    if (iterator == NULL) {
        return -1;
    }
    PyObject *key;
    int status = 0;
    while (status == 0 && (key = PyIter_Next(iterator)) != NULL) {
        PyObject *value = PyObject_GetItem(other, key);
        if (value == NULL || tree_insert(t, key, value, 1, NULL) < 0) {
            status = -1;
        }
        Py_XDECREF(value);
        Py_DECREF(key);
    }
    Py_DECREF(iterator);
    if (status == 0 && PyErr_Occurred()) {
        status = -1;
    }
    return status;
}

/* dict.update's rules: a mapping (anything with keys()) or pairs, then
 * the keyword arguments. */
static int
tree_update(TreeObject *t, PyObject *other, PyObject *kwds)
{
    if (other != NULL) {
        int status;
        if (Tree_Check(other)) {
            status = update_from_tree(t, (TreeObject *)other);
        }
        else if (PyDict_CheckExact(other)) {
            status = update_from_dict(t, other);
        }
        else {
            PyObject *keys_method = PyObject_GetAttrString(other, "keys");
            if (keys_method != NULL) {
                status = update_from_keys(t, other, keys_method);
                Py_DECREF(keys_method);
            }
            else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                status = update_from_pairs(t, other);
            }
            else {
                status = -1;
            }
        }
        if (status < 0) {
            return -1;
        }
    }
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        return update_from_dict(t, kwds);
    }
    return 0;
}

static PyObject *
Tree_update(TreeObject *t, PyObject *args, PyObject *kwds)
{
    PyObject *other = NULL;
    if (!PyArg_UnpackTuple(args, "update", 0, 1, &other)) {
        return NULL;
    }
    if (tree_update(t, other, kwds) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static int
Tree_init(TreeObject *t, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) > 1) {
        PyErr_Format(PyExc_TypeError, "RBTree expected at most 1 argument, got %zd",
                     PyTuple_GET_SIZE(args));
        return -1;
    }
    PyObject *other = PyTuple_GET_SIZE(args) ? PyTuple_GET_ITEM(args, 0) : NULL;
    return tree_update(t, other, kwds);
}

static PyObject *
Tree_clear_method(TreeObject *t, PyObject *unused)
{
    tree_clear(t);
    Py_RETURN_NONE;
}

static PyObject *
Tree_copy(TreeObject *t, PyObject *unused)
{
    if (!Py_IS_TYPE(t, &Tree_Type)) {
        /* a subclass: like OrderedDict, through its own constructor */
        return PyObject_CallOneArg((PyObject *)Py_TYPE(t), (PyObject *)t);
    }
    TreeObject *copy = (TreeObject *)Tree_new(&Tree_Type, NULL, NULL);
    if (copy == NULL) {
        return NULL;
    }
    if (tree_clone(copy, t) < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    return (PyObject *)copy;
}

/* (type, (), state, None, items iterator): pickle rebuilds the tree empty,
 * memoizes it, then sets the items, so a tree may contain itself. */
static PyObject *
Tree_reduce(TreeObject *t, PyObject *unused)
{
    PyObject *state = PyObject_GetAttrString((PyObject *)t, "__dict__");
    if (state == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return NULL;
        }
        PyErr_Clear();
    }
    if (state != NULL && PyDict_Check(state) && PyDict_GET_SIZE(state) == 0) {
        Py_CLEAR(state);
    }
    PyObject *items = tree_iter_mode(t, MODE_ITEMS, 0);
    if (items == NULL) {
        Py_XDECREF(state);
        return NULL;
    }
    PyObject *reduced = Py_BuildValue("O()OON", Py_TYPE(t), state ? state : Py_None,
                                      Py_None, items);
    Py_XDECREF(state);
    return reduced;
}

static PyObject *
Tree_sizeof(TreeObject *t, PyObject *unused)
{
    size_t bytes = (size_t)Py_TYPE(t)->tp_basicsize
                   + (size_t)t->capacity * (sizeof(Node) + sizeof(PyObject *));
    return PyLong_FromSize_t(bytes);
}

/* floor, ceiling, floor_key, ceiling_key. */
static PyObject *
bound_query(TreeObject *t, PyObject *const *args, Py_ssize_t nargs, const char *name,
            int which, int item)
{
    Probe probe;
    uint32_t x = 0;
    if (check_arity(name, nargs, 1, 2) < 0) {
        return NULL;
    }
    if (t->size != 0) {
        if (probe_init(t, args[0], &probe) < 0 || tree_bound(t, &probe, which, &x, NULL) < 0) {
            return NULL;
        }
    }
    if (x != 0) {
        return item ? node_item(t, x) : Py_NewRef(t->cells[x].key);
    }
    if (nargs == 2) {
        return Py_NewRef(args[1]);
    }
    set_key_error(args[0]);
    return NULL;
}

static PyObject *
Tree_floor(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    return bound_query(t, args, nargs, "floor", BOUND_FLOOR, 1);
}

static PyObject *
Tree_ceiling(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    return bound_query(t, args, nargs, "ceiling", BOUND_CEIL, 1);
}

static PyObject *
Tree_floor_key(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    return bound_query(t, args, nargs, "floor_key", BOUND_FLOOR, 0);
}

static PyObject *
Tree_ceiling_key(TreeObject *t, PyObject *const *args, Py_ssize_t nargs)
{
    return bound_query(t, args, nargs, "ceiling_key", BOUND_CEIL, 0);
}

static PyObject *
Tree_min(TreeObject *t, PyObject *unused)
{
    if (t->size == 0) {
        PyErr_SetString(PyExc_KeyError, "min(): RBTree is empty");
        return NULL;
    }
    return node_item(t, subtree_extreme(t->nodes, t->root, 0));
}

static PyObject *
Tree_max(TreeObject *t, PyObject *unused)
{
    if (t->size == 0) {
        PyErr_SetString(PyExc_KeyError, "max(): RBTree is empty");
        return NULL;
    }
    return node_item(t, subtree_extreme(t->nodes, t->root, 1));
}

static PyObject *
Tree_irange(TreeObject *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"lo", "hi", "inclusive", "reverse", "items", NULL};
    PyObject *lo = Py_None, *hi = Py_None, *inclusive = NULL;
    int reverse = 0, items = 0, lo_inclusive = 1, hi_inclusive = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO$Opp:irange", kwlist, &lo, &hi,
                                     &inclusive, &reverse, &items)) {
        return NULL;
    }
    if (inclusive != NULL) {
        if (!PyTuple_Check(inclusive) || PyTuple_GET_SIZE(inclusive) != 2) {
            PyErr_SetString(PyExc_TypeError, "irange(): inclusive must be a tuple of two bools");
            return NULL;
        }
        lo_inclusive = PyObject_IsTrue(PyTuple_GET_ITEM(inclusive, 0));
        if (lo_inclusive < 0) {
            return NULL;
        }
        hi_inclusive = PyObject_IsTrue(PyTuple_GET_ITEM(inclusive, 1));
        if (hi_inclusive < 0) {
            return NULL;
        }
    }
    int mode = items ? MODE_ITEMS : MODE_KEYS;
    if (t->size == 0) {
        return tree_iter_mode(t, mode, reverse);
    }
    Probe lo_probe, hi_probe;
    if (lo != Py_None && probe_init(t, lo, &lo_probe) < 0) {
        return NULL;
    }
    if (hi != Py_None && probe_init(t, hi, &hi_probe) < 0) {
        return NULL;
    }
    /* Start at one end of the range; the iterator checks the other. */
    PyObject *start_key = reverse ? hi : lo;
    PyObject *stop_key = reverse ? lo : hi;
    Probe *start_probe = reverse ? &hi_probe : &lo_probe;
    Probe *stop_probe = reverse ? &lo_probe : &hi_probe;
    int start_inclusive = reverse ? hi_inclusive : lo_inclusive;
    int stop_inclusive = reverse ? lo_inclusive : hi_inclusive;
    Walk walk;
    if (start_key == Py_None) {
        walk_start(t, &walk, reverse);
    }
    else {
        uint32_t start;
        int which = reverse ? (start_inclusive ? BOUND_FLOOR : BOUND_LOWER)
                            : (start_inclusive ? BOUND_CEIL : BOUND_HIGHER);
        if (tree_bound(t, start_probe, which, &start, &walk) < 0) {
            return NULL;
        }
    }
    return iter_new(t, &walk, t->version, mode, reverse,
                    stop_key == Py_None ? NULL : stop_key, stop_probe, stop_inclusive);
}

static PyObject *view_new(TreeObject *t, PyTypeObject *type);

static PyObject *
Tree_keys(TreeObject *t, PyObject *unused)
{
    return view_new(t, &Keys_Type);
}

static PyObject *
Tree_values(TreeObject *t, PyObject *unused)
{
    return view_new(t, &Values_Type);
}

static PyObject *
Tree_items(TreeObject *t, PyObject *unused)
{
    return view_new(t, &Items_Type);
}

static PyObject *
Tree_repr(TreeObject *t)
{
    PyObject *name = PyType_GetName(Py_TYPE(t));
    if (name == NULL) {
        return NULL;
    }
    PyObject *result = NULL;
    if (t->size == 0) {
        result = PyUnicode_FromFormat("%U()", name);
        Py_DECREF(name);
        return result;
    }
    int entered = Py_ReprEnter((PyObject *)t);
    if (entered != 0) {
        if (entered > 0) {
            result = PyUnicode_FromFormat("%U(...)", name);
        }
        Py_DECREF(name);
        return result;
    }
    PyObject *parts = PyList_New(0);
    if (parts == NULL) {
        goto done;
    }
    uint64_t version = t->version;
    Walk walk;
    walk_start(t, &walk, 0);
    for (uint32_t x; (x = walk_next(t, &walk, 0)) != 0;) {
        PyObject *key = Py_NewRef(t->cells[x].key);
        PyObject *value = Py_NewRef(t->cells[x].value);
        PyObject *part = PyUnicode_FromFormat("%R: %R", key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (part == NULL || PyList_Append(parts, part) < 0) {
            Py_XDECREF(part);
            goto done;
        }
        Py_DECREF(part);
        if (t->version != version) {
            PyErr_SetString(PyExc_RuntimeError, ITER_CHANGED);
            goto done;
        }
    }
    PyObject *separator = PyUnicode_FromString(", ");
    if (separator == NULL) {
        goto done;
    }
    PyObject *joined = PyUnicode_Join(separator, parts);
    Py_DECREF(separator);
    if (joined != NULL) {
        result = PyUnicode_FromFormat("%U({%U})", name, joined);
        Py_DECREF(joined);
    }

done:
    Py_XDECREF(parts);
    Py_ReprLeave((PyObject *)t);
    Py_DECREF(name);
    return result;
}

/* other[key] for __eq__: a new reference, NULL and no exception if the key
 * is missing (KeyError) or cannot be there (TypeError), NULL with an
 * exception otherwise. */
static PyObject *
mapping_lookup(PyObject *other, PyObject *key)
{
    PyObject *value;
    if (Tree_Check(other)) {
        TreeObject *tree = (TreeObject *)other;
        uint32_t x;
        if (tree_lookup(tree, key, &x) < 0) {
            value = NULL;
        }
        else {
            return x ? Py_NewRef(tree->cells[x].value) : NULL;
        }
    }
    else if (PyDict_CheckExact(other)) {
        value = PyDict_GetItemWithError(other, key);
        if (value != NULL) {
            return Py_NewRef(value);
        }
        if (!PyErr_Occurred()) {
            return NULL;
        }
    }
    else {
        value = PyObject_GetItem(other, key);
        if (value != NULL) {
            return value;
        }
    }
    if (PyErr_ExceptionMatches(PyExc_KeyError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
    }
    return NULL;
}

/* 1 if equal as mappings, 0 if not, -1 on error. */
static int
tree_equal(TreeObject *t, PyObject *other)
{
    Py_ssize_t other_size = PyObject_Size(other);
    if (other_size < 0) {
        return -1;
    }
    if (other_size != t->size) {
        return 0;
    }
    uint64_t version = t->version;
    Walk walk;
    walk_start(t, &walk, 0);
    for (uint32_t x; (x = walk_next(t, &walk, 0)) != 0;) {
        PyObject *key = Py_NewRef(t->cells[x].key);
        PyObject *value = Py_NewRef(t->cells[x].value);
        PyObject *other_value = mapping_lookup(other, key);
        int equal;
        if (other_value == NULL) {
            equal = PyErr_Occurred() ? -1 : 0;
        }
        else {
            equal = PyObject_RichCompareBool(value, other_value, Py_EQ);
            Py_DECREF(other_value);
        }
        Py_DECREF(key);
        Py_DECREF(value);
        if (equal <= 0) {
            return equal;
        }
        if (t->version != version) {
            PyErr_SetString(PyExc_RuntimeError, ITER_CHANGED);
            return -1;
        }
    }
    return 1;
}

static PyObject *
Tree_richcompare(TreeObject *t, PyObject *other, int op)
{
    if (op != Py_EQ && op != Py_NE) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (!Tree_Check(other) && !PyDict_Check(other)) {
        int is_mapping = PyObject_IsInstance(other, mapping_abc);
        if (is_mapping < 0) {
            return NULL;
        }
        if (!is_mapping) {
            Py_RETURN_NOTIMPLEMENTED;
        }
    }
    int equal = tree_equal(t, other);
    if (equal < 0) {
        return NULL;
    }
    return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

/* ------------------------------------------------------------ _check */

static int
check_fail(const char *format, unsigned long slot)
{
    PyErr_Format(PyExc_AssertionError, format, slot);
    return -1;
}

/* Check the subtree at x: every slot reached once (the C tree has no parent
 * links; this is what makes it a tree), colours, cached order words and
 * kinds.  *black_height gets its black height, *count its node count. */
static int
check_subtree(TreeObject *t, uint32_t x, int depth, unsigned char *seen, int *black_height,
              Py_ssize_t *count)
{
    if (x == 0) {
        *black_height = 1;
        return 0;
    }
    if (x >= t->used || t->cells[x].key == NULL || t->cells[x].value == NULL) {
        return check_fail("RBTree links to slot %lu, which is not in use", x);
    }
    if (seen[x]) {
        return check_fail("RBTree reaches slot %lu twice", x);
    }
    seen[x] = 1;
    if (depth >= MAX_DEPTH - 2) {
        return check_fail("RBTree is deeper than a red-black tree can be at slot %lu", x);
    }
    const Node *nodes = t->nodes;
    uint32_t left = child(nodes, x, 0), right = child(nodes, x, 1);
    if (nodes[x].link[1] & RED_BIT) {
        return check_fail("RBTree slot %lu has a stray bit in its right link", x);
    }
    if (is_red(nodes, x) && (is_red(nodes, left) || is_red(nodes, right))) {
        return check_fail("RBTree red node %lu has a red child", x);
    }
    PyObject *key = t->cells[x].key;
    if (key_kind(key) != t->kind
        || (t->kind == KIND_OBJECT && !PyObject_TypeCheck(key, t->key_type))) {
        return check_fail("RBTree node %lu holds a key of another kind", x);
    }
    if (t->kind != KIND_OBJECT) {
        Probe probe;
        if (probe_init(t, key, &probe) < 0) {
            return -1;
        }
        if (probe.ord != nodes[x].ord) {
            return check_fail("RBTree node %lu caches a wrong order word", x);
        }
    }
    if (PyObject_IS_GC(key) && !t->keys_gc) {
        return check_fail("RBTree node %lu holds a GC key the GC is not shown", x);
    }
    int left_height, right_height;
    if (check_subtree(t, left, depth + 1, seen, &left_height, count) < 0
        || check_subtree(t, right, depth + 1, seen, &right_height, count) < 0) {
        return -1;
    }
    if (left_height != right_height) {
        return check_fail("RBTree black heights differ below node %lu", x);
    }
    *black_height = left_height + !is_red(t->nodes, x);
    (*count)++;
    return 0;
}

/* The structural checks of _check; -1 with AssertionError. */
static int
check_structure(TreeObject *t)
{
    if (t->size == 0) {
        if (t->root != 0 || t->kind != KIND_NONE || t->key_type != NULL || t->nodes != NULL) {
            PyErr_SetString(PyExc_AssertionError, "empty RBTree keeps a root, kind or storage");
            return -1;
        }
        return 0;
    }
    if (t->kind == KIND_NONE || (t->kind == KIND_OBJECT) != (t->key_type != NULL)) {
        PyErr_SetString(PyExc_AssertionError, "RBTree has items but no consistent kind");
        return -1;
    }
    if (t->root == 0 || is_red(t->nodes, t->root)) {
        PyErr_SetString(PyExc_AssertionError, "RBTree root is missing or red");
        return -1;
    }
    if (t->nodes[0].link[0] != 0 || t->nodes[0].link[1] != 0 || t->cells[0].key != NULL) {
        PyErr_SetString(PyExc_AssertionError, "RBTree nil slot was written to");
        return -1;
    }
    unsigned char *seen = PyMem_Calloc(t->used, 1);
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int black_height;
    Py_ssize_t count = 0;
    int status = check_subtree(t, t->root, 0, seen, &black_height, &count);
    PyMem_Free(seen);
    if (status < 0) {
        return -1;
    }
    if (count != t->size) {
        PyErr_Format(PyExc_AssertionError, "RBTree size is %zd but it has %zd nodes",
                     t->size, count);
        return -1;
    }
    Py_ssize_t free_slots = 0;
    for (uint32_t x = t->free_list; x != 0; x = t->nodes[x].link[1]) {
        if (x >= t->used || t->cells[x].key != NULL || free_slots > (Py_ssize_t)t->used) {
            PyErr_SetString(PyExc_AssertionError, "RBTree free list is corrupt");
            return -1;
        }
        free_slots++;
    }
    if (free_slots + t->size + 1 != (Py_ssize_t)t->used) {
        PyErr_SetString(PyExc_AssertionError, "RBTree has lost slots");
        return -1;
    }
    return 0;
}

static PyObject *
Tree_check(TreeObject *t, PyObject *unused)
{
    if (check_structure(t) < 0) {
        return NULL;
    }
    /* In-order keys strictly ascending (object keys: by `<`). */
    uint64_t version = t->version;
    Walk walk;
    walk_start(t, &walk, 0);
    uint32_t previous = walk_next(t, &walk, 0);
    for (uint32_t x; (x = walk_next(t, &walk, 0)) != 0; previous = x) {
        int ascending;
        if (t->kind == KIND_OBJECT) {
            ascending = object_less(t, t->cells[previous].key, t->cells[x].key);
            if (ascending < 0) {
                return NULL;
            }
        }
        else {
            Probe probe;
            if (probe_init(t, t->cells[previous].key, &probe) < 0) {
                return NULL;
            }
            ascending = fast_compare(t, &probe, x) < 0;
        }
        if (!ascending) {
            PyObject *key = Py_NewRef(t->cells[x].key);
            PyErr_Format(PyExc_AssertionError, "RBTree keys are not strictly ascending at %R",
                         key);
            Py_DECREF(key);
            return NULL;
        }
        if (t->version != version) {
            PyErr_SetString(PyExc_RuntimeError, COMPARE_CHANGED);
            return NULL;
        }
    }
    Py_RETURN_NONE;
}


/* ------------------------------------------------------------ views */

typedef struct {
    PyObject_HEAD
    TreeObject *tree;
} ViewObject;

static PyObject *
view_new(TreeObject *t, PyTypeObject *type)
{
    ViewObject *view = PyObject_GC_New(ViewObject, type);
    if (view == NULL) {
        return NULL;
    }
    view->tree = (TreeObject *)Py_NewRef(t);
    PyObject_GC_Track(view);
    return (PyObject *)view;
}

static void
View_dealloc(ViewObject *view)
{
    PyObject_GC_UnTrack(view);
    Py_DECREF(view->tree);
    PyObject_GC_Del(view);
}

static int
View_traverse(ViewObject *view, visitproc visit, void *arg)
{
    Py_VISIT(view->tree);
    return 0;
}

static Py_ssize_t
View_length(ViewObject *view)
{
    return view->tree->size;
}

static int
view_mode(PyObject *view)
{
    if (Py_IS_TYPE(view, &Keys_Type)) {
        return MODE_KEYS;
    }
    return Py_IS_TYPE(view, &Values_Type) ? MODE_VALUES : MODE_ITEMS;
}

static PyObject *
View_iter(ViewObject *view)
{
    return tree_iter_mode(view->tree, view_mode((PyObject *)view), 0);
}

static PyObject *
View_reversed(ViewObject *view, PyObject *unused)
{
    return tree_iter_mode(view->tree, view_mode((PyObject *)view), 1);
}

static PyObject *
View_repr(ViewObject *view)
{
    PyObject *name = PyType_GetName(Py_TYPE(view));
    if (name == NULL) {
        return NULL;
    }
    PyObject *result = NULL;
    int entered = Py_ReprEnter((PyObject *)view);
    if (entered != 0) {
        if (entered > 0) {
            result = PyUnicode_FromFormat("%U(...)", name);
        }
        Py_DECREF(name);
        return result;
    }
    PyObject *listed = PySequence_List((PyObject *)view);
    if (listed != NULL) {
        result = PyUnicode_FromFormat("%U(%R)", name, listed);
        Py_DECREF(listed);
    }
    Py_ReprLeave((PyObject *)view);
    Py_DECREF(name);
    return result;
}

static int
Keys_contains(ViewObject *view, PyObject *key)
{
    return Tree_contains(view->tree, key);
}

static int
Values_contains(ViewObject *view, PyObject *value)
{
    TreeObject *t = view->tree;
    uint64_t version = t->version;
    Walk walk;
    walk_start(t, &walk, 0);
    for (uint32_t x; (x = walk_next(t, &walk, 0)) != 0;) {
        PyObject *held = Py_NewRef(t->cells[x].value);
        int equal = PyObject_RichCompareBool(held, value, Py_EQ);
        Py_DECREF(held);
        if (equal != 0) {
            return equal;
        }
        if (t->version != version) {
            PyErr_SetString(PyExc_RuntimeError, ITER_CHANGED);
            return -1;
        }
    }
    return 0;
}

static int
Items_contains(ViewObject *view, PyObject *item)
{
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
        return 0;
    }
    TreeObject *t = view->tree;
    uint32_t x;
    if (tree_lookup(t, PyTuple_GET_ITEM(item, 0), &x) < 0) {
        return -1;
    }
    if (x == 0) {
        return 0;
    }
    PyObject *held = Py_NewRef(t->cells[x].value);
    int equal = PyObject_RichCompareBool(held, PyTuple_GET_ITEM(item, 1), Py_EQ);
    Py_DECREF(held);
    return equal;
}

/* set(a) <method>(b): the set operations of dict views, for either
 * operand order. */
static PyObject *
view_set_operation(PyObject *a, PyObject *b, const char *method)
{
    PyObject *result = PySet_New(a);
    if (result == NULL) {
        return NULL;
    }
    PyObject *done = PyObject_CallMethod(result, method, "O", b);
    if (done == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(done);
    return result;
}

static PyObject *
View_and(PyObject *a, PyObject *b)
{
    return view_set_operation(a, b, "intersection_update");
}

static PyObject *
View_or(PyObject *a, PyObject *b)
{
    return view_set_operation(a, b, "update");
}

static PyObject *
View_xor(PyObject *a, PyObject *b)
{
    return view_set_operation(a, b, "symmetric_difference_update");
}

static PyObject *
View_sub(PyObject *a, PyObject *b)
{
    return view_set_operation(a, b, "difference_update");
}

static PyObject *
View_isdisjoint(ViewObject *view, PyObject *other)
{
    PyObject *own = PySet_New((PyObject *)view);
    if (own == NULL) {
        return NULL;
    }
    PyObject *result = PyObject_CallMethod(own, "isdisjoint", "O", other);
    Py_DECREF(own);
    return result;
}

static int
set_like(PyObject *other)
{
    return PyAnySet_Check(other) || PyDictKeys_Check(other) || PyDictItems_Check(other)
           || Py_IS_TYPE(other, &Keys_Type) || Py_IS_TYPE(other, &Items_Type);
}

/* Keys and items views compare as sets with sets and set-like views. */
static PyObject *
View_richcompare(PyObject *view, PyObject *other, int op)
{
    if (!set_like(other)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *own = PySet_New(view);
    if (own == NULL) {
        return NULL;
    }
    PyObject *theirs = PyAnySet_Check(other) ? Py_NewRef(other) : PySet_New(other);
    if (theirs == NULL) {
        Py_DECREF(own);
        return NULL;
    }
    PyObject *result = PyObject_RichCompare(own, theirs, op);
    Py_DECREF(own);
    Py_DECREF(theirs);
    return result;
}

static PyNumberMethods View_as_number = {
    .nb_subtract = View_sub,
    .nb_and = View_and,
    .nb_xor = View_xor,
    .nb_or = View_or,
};

static PyMethodDef View_methods[] = {
    {"__reversed__", (PyCFunction)View_reversed, METH_NOARGS,
     PyDoc_STR("An iterator in descending key order.")},
    {NULL, NULL},
};

static PyMethodDef SetView_methods[] = {
    {"__reversed__", (PyCFunction)View_reversed, METH_NOARGS,
     PyDoc_STR("An iterator in descending key order.")},
    {"isdisjoint", (PyCFunction)View_isdisjoint, METH_O,
     PyDoc_STR("True if the view and the iterable have no element in common.")},
    {NULL, NULL},
};

static PySequenceMethods Keys_as_sequence = {
    .sq_length = (lenfunc)View_length,
    .sq_contains = (objobjproc)Keys_contains,
};

static PySequenceMethods Values_as_sequence = {
    .sq_length = (lenfunc)View_length,
    .sq_contains = (objobjproc)Values_contains,
};

static PySequenceMethods Items_as_sequence = {
    .sq_length = (lenfunc)View_length,
    .sq_contains = (objobjproc)Items_contains,
};

static PyTypeObject Keys_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._rbtree.RBTreeKeys",
    .tp_basicsize = sizeof(ViewObject),
    .tp_dealloc = (destructor)View_dealloc,
    .tp_repr = (reprfunc)View_repr,
    .tp_as_number = &View_as_number,
    .tp_as_sequence = &Keys_as_sequence,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("The keys of an RBTree, in key order; a set-like view."),
    .tp_traverse = (traverseproc)View_traverse,
    .tp_richcompare = View_richcompare,
    .tp_iter = (getiterfunc)View_iter,
    .tp_methods = SetView_methods,
};

static PyTypeObject Values_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._rbtree.RBTreeValues",
    .tp_basicsize = sizeof(ViewObject),
    .tp_dealloc = (destructor)View_dealloc,
    .tp_repr = (reprfunc)View_repr,
    .tp_as_sequence = &Values_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("The values of an RBTree, in key order."),
    .tp_traverse = (traverseproc)View_traverse,
    .tp_iter = (getiterfunc)View_iter,
    .tp_methods = View_methods,
};

static PyTypeObject Items_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._rbtree.RBTreeItems",
    .tp_basicsize = sizeof(ViewObject),
    .tp_dealloc = (destructor)View_dealloc,
    .tp_repr = (reprfunc)View_repr,
    .tp_as_number = &View_as_number,
    .tp_as_sequence = &Items_as_sequence,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("The (key, value) items of an RBTree, in key order; a set-like "
                        "view."),
    .tp_traverse = (traverseproc)View_traverse,
    .tp_richcompare = View_richcompare,
    .tp_iter = (getiterfunc)View_iter,
    .tp_methods = SetView_methods,
};


/* ------------------------------------------------------------ type */

/* any C method, cast for PyMethodDef */
#define METHOD(f) ((PyCFunction)(void (*)(void))(f))

static PyMethodDef Tree_methods[] = {
    {"get", METHOD(Tree_get), METH_FASTCALL,
     PyDoc_STR("get(key, default=None, /)\n--\n\n"
               "The value of key, or default.  A key of another kind than the "
               "tree's raises TypeError.")},
    {"pop", METHOD(Tree_pop), METH_FASTCALL,
     PyDoc_STR("pop(key[, default], /)\n--\n\n"
               "Remove key and return its value; if absent return default, or "
               "raise KeyError.")},
    {"popitem", METHOD(Tree_popitem), METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("popitem(last=True)\n--\n\n"
               "Remove and return the (key, value) item with the largest key "
               "(the smallest if last is false); KeyError if empty.")},
    {"setdefault", METHOD(Tree_setdefault), METH_FASTCALL,
     PyDoc_STR("setdefault(key, default=None, /)\n--\n\n"
               "The value of key; if absent, insert key with default first.")},
    {"update", METHOD(Tree_update), METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("update([other, ]**kwargs)\n--\n\n"
               "Store the items of a mapping (anything with keys()) or of an "
               "iterable of pairs, then the keyword arguments, like dict.update.")},
    {"clear", (PyCFunction)Tree_clear_method, METH_NOARGS,
     PyDoc_STR("Remove every item; the tree forgets its key kind.")},
    {"keys", (PyCFunction)Tree_keys, METH_NOARGS,
     PyDoc_STR("A set-like view of the keys, in ascending order.")},
    {"values", (PyCFunction)Tree_values, METH_NOARGS,
     PyDoc_STR("A view of the values, in key order.")},
    {"items", (PyCFunction)Tree_items, METH_NOARGS,
     PyDoc_STR("A set-like view of the (key, value) items, in key order.")},
    {"copy", (PyCFunction)Tree_copy, METH_NOARGS,
     PyDoc_STR("A shallow copy, in O(n).")},
    {"__copy__", (PyCFunction)Tree_copy, METH_NOARGS, PyDoc_STR("A shallow copy.")},
    {"__reduce__", (PyCFunction)Tree_reduce, METH_NOARGS, PyDoc_STR("Pickle support.")},
    {"__reversed__", (PyCFunction)Tree_reversed, METH_NOARGS,
     PyDoc_STR("An iterator over the keys in descending order.")},
    {"__sizeof__", (PyCFunction)Tree_sizeof, METH_NOARGS,
     PyDoc_STR("Bytes used by the tree and its node storage (not the keys and values).")},
    {"floor", METHOD(Tree_floor), METH_FASTCALL,
     PyDoc_STR("floor(key[, default], /)\n--\n\n"
               "The (key, value) item with the largest key <= key; if none, "
               "default, or KeyError(key).  O(log n).")},
    {"ceiling", METHOD(Tree_ceiling), METH_FASTCALL,
     PyDoc_STR("ceiling(key[, default], /)\n--\n\n"
               "The (key, value) item with the smallest key >= key; if none, "
               "default, or KeyError(key).  O(log n).")},
    {"floor_key", METHOD(Tree_floor_key), METH_FASTCALL,
     PyDoc_STR("floor_key(key[, default], /)\n--\n\n"
               "The largest key <= key; if none, default, or KeyError(key).")},
    {"ceiling_key", METHOD(Tree_ceiling_key), METH_FASTCALL,
     PyDoc_STR("ceiling_key(key[, default], /)\n--\n\n"
               "The smallest key >= key; if none, default, or KeyError(key).")},
    {"min", (PyCFunction)Tree_min, METH_NOARGS,
     PyDoc_STR("The (key, value) item with the smallest key; KeyError if empty.")},
    {"max", (PyCFunction)Tree_max, METH_NOARGS,
     PyDoc_STR("The (key, value) item with the largest key; KeyError if empty.")},
    {"irange", METHOD(Tree_irange), METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("irange(lo=None, hi=None, *, inclusive=(True, True), reverse=False, "
               "items=False)\n--\n\n"
               "An iterator over the keys (or (key, value) items) in [lo, hi], "
               "None meaning unbounded; inclusive says whether each bound "
               "belongs to the range.  O(log n) to start, O(1) amortized per step.")},
    {"_check", (PyCFunction)Tree_check, METH_NOARGS,
     PyDoc_STR("Verify every red-black invariant; AssertionError if one fails.")},
    {"__class_getitem__", Py_GenericAlias, METH_O | METH_CLASS,
     PyDoc_STR("See PEP 585.")},
    {NULL, NULL},
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
"RBTree(other=(), /, **kwargs)\n--\n\n"
"An ordered mutable mapping kept in a red-black tree.\n\n"
"Keys are of one kind, fixed by the first key and forgotten when the tree\n"
"is empty: 'int' (int and its subclasses, bool included, ordered by value),\n"
"'bytes' (exact bytes) or 'object' (instances of the first key's type,\n"
"ordered by <).  A key of another kind raises TypeError, in lookups too\n"
"(`key in tree`, get, floor...).  Lookups, insertions, removals, floor and\n"
"ceiling are O(log n).  Iterators raise RuntimeError once a key was\n"
"inserted or removed; replacing a value does not disturb them.");

static PyTypeObject Tree_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "domus._rbtree.RBTree",
    .tp_basicsize = sizeof(TreeObject),
    .tp_dealloc = (destructor)Tree_dealloc,
    .tp_repr = (reprfunc)Tree_repr,
    .tp_as_sequence = &Tree_as_sequence,
    .tp_as_mapping = &Tree_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC
                | Py_TPFLAGS_MAPPING,
    .tp_doc = Tree_doc,
    .tp_traverse = (traverseproc)Tree_traverse,
    .tp_clear = (inquiry)Tree_tp_clear,
    .tp_richcompare = (richcmpfunc)Tree_richcompare,
    .tp_iter = (getiterfunc)Tree_iter,
    .tp_methods = Tree_methods,
    .tp_init = (initproc)Tree_init,
    .tp_new = Tree_new,
};


/* ------------------------------------------------------------ C API */

static PyObject *
capi_get(PyObject *tree, PyObject *key)
{
    TreeObject *t = (TreeObject *)tree;
    uint32_t x;
    if (tree_lookup(t, key, &x) < 0) {
        return NULL;
    }
    return x ? t->cells[x].value : NULL;
}

static int
capi_put(PyObject *tree, PyObject *key, PyObject *value)
{
    return tree_insert((TreeObject *)tree, key, value, 1, NULL);
}

static int
capi_remove(PyObject *tree, PyObject *key)
{
    return tree_discard((TreeObject *)tree, key, NULL);
}

static int
capi_contains(PyObject *tree, PyObject *key)
{
    return Tree_contains((TreeObject *)tree, key);
}

static Py_ssize_t
capi_size(PyObject *tree)
{
    return ((TreeObject *)tree)->size;
}

static DomusRBTreeAPI capi = {
    .type = &Tree_Type,
    .get = capi_get,
    .put = capi_put,
    .remove = capi_remove,
    .contains = capi_contains,
    .size = capi_size,
};


/* ------------------------------------------------------------ module */

/* abc.register(type) for each (abc name, type) pair. */
static int
register_abcs(void)
{
    static const struct {
        const char *abc;
        PyTypeObject *type;
    } registrations[] = {
        {"MutableMapping", &Tree_Type},
        {"KeysView", &Keys_Type},
        {"ValuesView", &Values_Type},
        {"ItemsView", &Items_Type},
    };
    PyObject *abc_module = PyImport_ImportModule("collections.abc");
    if (abc_module == NULL) {
        return -1;
    }
    int status = 0;
    mapping_abc = PyObject_GetAttrString(abc_module, "Mapping");
    if (mapping_abc == NULL) {
        status = -1;
    }
    for (size_t i = 0; status == 0 && i < sizeof(registrations) / sizeof(registrations[0]); i++) {
        PyObject *abc = PyObject_GetAttrString(abc_module, registrations[i].abc);
        if (abc == NULL) {
            status = -1;
            break;
        }
        PyObject *done = PyObject_CallMethod(abc, "register", "O", registrations[i].type);
        Py_DECREF(abc);
        if (done == NULL) {
            status = -1;
        }
        Py_XDECREF(done);
    }
    Py_DECREF(abc_module);
    return status;
}

static struct PyModuleDef rbtree_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "domus._rbtree",
    .m_doc = PyDoc_STR("RBTree, an ordered mapping kept in a red-black tree (C).  The "
                       "pure-Python reference is domus.rbtree.reference."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__rbtree(void)
{
    PyTypeObject *types[] = {&Tree_Type, &Iter_Type, &Keys_Type, &Values_Type, &Items_Type};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (PyType_Ready(types[i]) < 0) {
            return NULL;
        }
    }
    PyObject *module = PyModule_Create(&rbtree_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddType(module, &Tree_Type) < 0
        || PyModule_AddType(module, &Iter_Type) < 0
        || PyModule_AddType(module, &Keys_Type) < 0
        || PyModule_AddType(module, &Values_Type) < 0
        || PyModule_AddType(module, &Items_Type) < 0) {
        goto fail;
    }
    PyObject *capsule = PyCapsule_New(&capi, DOMUS_RBTREE_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(module, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        goto fail;
    }
    if (register_abcs() < 0) {
        goto fail;
    }
    return module;

fail:
    Py_DECREF(module);
    return NULL;
}
