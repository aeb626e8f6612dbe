// What Metal compiles (the Rust side concatenates the same three files).
#include "prelude_metal.h"
#include "kv_elem.h"
#include "kv_ops.h"
