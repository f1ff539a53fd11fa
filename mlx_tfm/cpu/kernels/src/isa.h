// What MLX_TFM_KERNELS_ISA asks for and what this CPU runs (dispatch.cpp). Apart from
// kernels.h, which every kernels_<isa>.cpp includes: nothing of the standard library's
// inline code may be compiled with an instruction set's flags.
#pragma once

#include <string>
#include <vector>

namespace mlx_tfm_kernels {

// Why MLX_TFM_KERNELS_ISA cannot be honoured (one line), or empty when it can.
const std::string& isa_request_error();

// The sets this build holds that this CPU runs, best first.
std::vector<std::string> runnable_isas();

}  // namespace mlx_tfm_kernels
