// module.cpp: the `lily._core` extension module. One init_* per binding file.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_model(nb::module_& m);
void init_sampling(nb::module_& m);
void init_testing(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "Lily's compiled core: Model, Session, Generator and the sampler.";
  init_sampling(m);
  init_model(m);
  init_testing(m);
}
