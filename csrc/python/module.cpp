// module.cpp: the `lily._core` extension module. One init_* per binding file.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_model(nb::module_& m);
void init_sampling(nb::module_& m);
void init_testing(nb::module_& m);

// Test builds (the Metal CPU harness) compile the same sources under another module name.
#ifndef LILY_MODULE_NAME
#define LILY_MODULE_NAME _core
#endif
#define LILY_NB_MODULE(name, m) NB_MODULE(name, m)

LILY_NB_MODULE(LILY_MODULE_NAME, m) {
  m.doc() = "Lily's compiled core: Model, Session, Generator and the sampler.";
  init_sampling(m);
  init_model(m);
  init_testing(m);
}
