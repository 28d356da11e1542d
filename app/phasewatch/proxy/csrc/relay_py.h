/* The Python types of the native leg's thread (relay_py.c): `Relay` and `Stream`. */
#ifndef PW_RELAY_PY_H
#define PW_RELAY_PY_H
#ifdef __linux__
#include <Python.h>

extern PyTypeObject RelayType;
extern PyTypeObject StreamType;

#endif
#endif
