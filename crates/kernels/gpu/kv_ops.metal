// What Metal compiles: the Rust side inlines these headers (gpu::metal_source).
#include "prelude_metal.h"
#include "kv_elem.h"
#include "kv_ops.h"
