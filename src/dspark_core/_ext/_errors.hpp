// Binding-side translation of C++ exceptions into Python exceptions. Lives in
// the Python package (not csrc/) because it needs Python.h; the core itself
// knows nothing of Python. Used by the .pxd files as
// `except +dspark_translate_exception`.
#pragma once
#include <Python.h>
#include <new>
#include <stdexcept>
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

// Called by Cython inside a catch(...) block: rethrow and map.
inline void dspark_translate_exception() {
    try {
        if (PyErr_Occurred()) return;  // a Python error is already set
        throw;
    } catch (const dspark::ConfigError& e) {
        PyObject* t = dspark_config_error_type();
        PyErr_SetString(t ? t : PyExc_ValueError, e.what());
    } catch (const dspark::StateError& e) {
        PyObject* t = dspark_state_error_type();
        PyErr_SetString(t ? t : PyExc_RuntimeError, e.what());
    } catch (const dspark::TypeError& e) {
        PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const std::invalid_argument& e) {
        PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::out_of_range& e) {
        PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::bad_alloc&) {
        PyErr_SetString(PyExc_MemoryError, "dspark_core: out of memory");
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "dspark_core: unknown C++ exception");
    }
}
