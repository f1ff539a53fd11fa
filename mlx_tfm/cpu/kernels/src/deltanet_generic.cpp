// The chunked delta rule's portable kernel: plain loops the compiler vectorizes for the
// build's baseline (NEON on arm64, SSE2 on x86-64).
#define ISA_NAMESPACE generic
#define ISA_LABEL "generic"
#include "deltanet_body.inc"
