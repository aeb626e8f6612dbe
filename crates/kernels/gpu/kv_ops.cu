// What nvcc compiles: the CUDA prelude and the shared kernel bodies.
#include "prelude_cuda.h"
#include "kv_elem.h"
#include "kv_ops.h"
