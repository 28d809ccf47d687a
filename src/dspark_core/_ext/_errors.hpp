// Binding-side translation of C++ exceptions into Python exceptions. Lives in
// the Python package (not csrc/) because it needs Python.h; the core itself
// knows nothing of Python. Used by the .pxd files as
// `except +dspark_translate_exception`. Which kind an exception is, and which
// Python exception each kind becomes, is the core's one table
// (DSPARK_ERROR_KINDS in dspark/errors.hpp).
#pragma once
#include <Python.h>

#include "dspark/errors.hpp"

// Set once at import by the extension module (strong references kept there).
inline PyObject*& dspark_config_error_type() { static PyObject* t = nullptr; return t; }
inline PyObject*& dspark_state_error_type() { static PyObject* t = nullptr; return t; }

inline void dspark_set_error_types(PyObject* config_error, PyObject* state_error) {
    Py_XINCREF(config_error);
    Py_XINCREF(state_error);
    dspark_config_error_type() = config_error;
    dspark_state_error_type() = state_error;
}

// The Python classes DSPARK_ERROR_KINDS names: builtins, and the package's
// own two (their bases until dspark_set_error_types registered them).
inline PyObject* dspark_py_ValueError() { return PyExc_ValueError; }
inline PyObject* dspark_py_TypeError() { return PyExc_TypeError; }
inline PyObject* dspark_py_MemoryError() { return PyExc_MemoryError; }
inline PyObject* dspark_py_RuntimeError() { return PyExc_RuntimeError; }
inline PyObject* dspark_py_ConfigError() {
    PyObject* t = dspark_config_error_type();
    return t ? t : PyExc_ValueError;
}
inline PyObject* dspark_py_StateError() {
    PyObject* t = dspark_state_error_type();
    return t ? t : PyExc_RuntimeError;
}

inline PyObject* dspark_python_error(dspark::ErrorKind kind) {
    switch (kind) {
#define DSPARK_PY_CASE(k, c_status, python) \
    case dspark::ErrorKind::k: return dspark_py_##python();
        DSPARK_ERROR_KINDS(DSPARK_PY_CASE)
#undef DSPARK_PY_CASE
    }
    return PyExc_RuntimeError;
}

// Called by Cython inside a catch(...) block: classify and raise.
inline void dspark_translate_exception() {
    if (PyErr_Occurred()) return;  // a Python error is already set
    const dspark::CaughtError e = dspark::classify_current_error();
    PyErr_SetString(dspark_python_error(e.kind), e.what);
}
