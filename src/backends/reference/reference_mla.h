// The REFERENCE MLA pieces (fp64, naive, any dimensions, cpu):
//   reference_mla_backend()          "REFERENCE_MLA": an MLABackend whose impl is an INDEPENDENT
//                                    oracle of the un-absorbed MLA formula (it does not use
//                                    MLACommonImpl); builder = MLACommonMetadataBuilder.
//                                    Registered last in backends/registry.cpp.
//   reference_mla_prefill_backend()  "REFERENCE": the fp64 MLA prefill backend, registered last
//                                    in backends/mla/prefill_registry.cpp.
#pragma once

#include "pagedattn/backend.h"
#include "pagedattn/mla.h"

namespace pagedattn {

const AttentionBackend& reference_mla_backend();
const MLAPrefillBackendClass& reference_mla_prefill_backend();

}  // namespace pagedattn
