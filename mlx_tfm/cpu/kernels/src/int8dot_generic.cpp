// The int8-activation products' portable loops (the compiler vectorizes them for the
// build's baseline: NEON on arm64, SSE2 on x86-64).
#define ISA_NAMESPACE generic
#define ISA_LABEL "generic"
#include "int8dot_body.inc"
