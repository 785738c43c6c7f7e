/* The C interface of domus._rbtree for other extensions (domus._hotpath).
 *
 * domus._rbtree exports a capsule named "domus._rbtree._C_API" whose pointer
 * is a DomusRBTreeAPI.  Get it with
 *     api = PyCapsule_Import(DOMUS_RBTREE_CAPSULE, 0);
 * Every function takes a tree already checked with
 *     Py_IS_TYPE(obj, api->type)   (or PyObject_TypeCheck)
 * and follows the same rules as the Python methods: a key of the wrong kind
 * is a TypeError and changes nothing.
 */
#ifndef DOMUS_RBTREE_API_H
#define DOMUS_RBTREE_API_H

#include <Python.h>

#define DOMUS_RBTREE_CAPSULE "domus._rbtree._C_API"

typedef struct {
    PyTypeObject *type;
    /* Borrowed reference to the value, or NULL.  NULL without an exception
     * set means the key is absent. */
    PyObject *(*get)(PyObject *tree, PyObject *key);
    /* 1: the key was new, 0: its value was replaced, -1: error. */
    int (*put)(PyObject *tree, PyObject *key, PyObject *value);
    /* 1: removed, 0: absent, -1: error. */
    int (*remove)(PyObject *tree, PyObject *key);
    /* 1: present, 0: absent, -1: error. */
    int (*contains)(PyObject *tree, PyObject *key);
    /* Number of items. */
    Py_ssize_t (*size)(PyObject *tree);
} DomusRBTreeAPI;

#endif
