/* The C interface of domus._recordtree for other extensions (domus._hotpath).
 *
 * domus._recordtree exports a capsule named "domus._recordtree._C_API"
 * whose pointer is a DomusRecordTreeAPI.  Get it with
 *     api = PyCapsule_Import(DOMUS_RECORDTREE_CAPSULE, 0);
 * Every function takes a tree already checked with
 *     PyObject_TypeCheck(obj, api->type)
 * and bytes as they are (a pointer and a length), so a caller that holds a
 * key or value in a buffer of its own (a datagram) stores it and reads it
 * back without making a Python object.  No function runs Python code.
 * Bytes handed to put must not lie in the arena of the tree they go to
 * (storing may move it).
 */
#ifndef DOMUS_RECORDTREE_API_H
#define DOMUS_RECORDTREE_API_H

#include <Python.h>

#define DOMUS_RECORDTREE_CAPSULE "domus._recordtree._C_API"

typedef struct {
    PyTypeObject *type;
    /* 1 if `key` is present, with its value's bytes in *value and
     * *value_size (either may be NULL: not wanted); they point into the
     * tree's arena and stay valid until the tree next changes.  0 if
     * absent.  Never fails. */
    int (*find)(PyObject *tree, const char *key, Py_ssize_t key_size,
                const char **value, Py_ssize_t *value_size);
    /* Store `value` under `key`, both copied into the tree.  1: the key was
     * new, 0: its value was replaced, -1 with an exception set and the tree
     * unchanged (MemoryError; KeyTooLarge/ValueTooLarge for a key of more
     * than 16,383 bytes or a value of 4 GiB or more). */
    int (*put)(PyObject *tree, const char *key, Py_ssize_t key_size,
               const char *value, Py_ssize_t value_size);
    /* 1: removed, 0: absent.  Never fails. */
    int (*remove)(PyObject *tree, const char *key, Py_ssize_t key_size);
    /* Number of records. */
    Py_ssize_t (*size)(PyObject *tree);
    /* A hint before `count` finds or puts (a batch): walks the descents of
     * all the keys at once, each step prefetching the next node of every
     * walk, so that their cache misses overlap instead of following one
     * another; the finds and puts that follow then find those nodes in
     * the cache.  trees[i] is key i's tree (already checked).  Changes
     * nothing, never fails; count at most DOMUS_RECORDTREE_PREFETCH. */
    void (*prefetch)(PyObject *const *trees, const char *const *keys,
                     const Py_ssize_t *key_sizes, Py_ssize_t count);
} DomusRecordTreeAPI;

/* How many descents prefetch walks at once. */
#define DOMUS_RECORDTREE_PREFETCH 16

#endif
