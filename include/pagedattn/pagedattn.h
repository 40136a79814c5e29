// Umbrella header: everything a serving engine needs.
#pragma once

#include "pagedattn/attention_type.h"
#include "pagedattn/backend.h"
#include "pagedattn/batch_invariance.h"
#include "pagedattn/dcp.h"
#include "pagedattn/device.h"
#include "pagedattn/dtype.h"
#include "pagedattn/error.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
#include "pagedattn/mla.h"
#include "pagedattn/ops.h"
#include "pagedattn/selector.h"
#include "pagedattn/tensor.h"
