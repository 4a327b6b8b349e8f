// The call core, compiled as one translation unit. Its source is one file per job (see
// call_core.h); each would parse torch's headers on its own, ~10 s apiece, where together they
// parse them once: the core builds in about the time one of its files would take alone.
#include "module.cpp"
#include "key.cpp"
#include "checks.cpp"
#include "bound.cpp"
#include "unalias.cpp"
#include "layout.cpp"
#include "graph.cpp"
