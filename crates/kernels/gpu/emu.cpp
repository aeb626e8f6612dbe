// The kernel-emu build: the shared kernel bodies compiled for the CPU.
#include "prelude_host.h"
#include "kv_elem.h"
#include "kv_ops.h"
