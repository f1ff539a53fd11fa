// Picks the instruction set at run time from what the CPU reports, or the one
// MLX_TFM_KERNELS_ISA names; a name it does not know, or a set this CPU lacks, is an error
// the caller sees (isa_request_error), never a quiet fallback to another set.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "isa.h"
#include "kernels.h"

namespace mlx_tfm_kernels {

namespace {

constexpr const char* ISA_VARIABLE = "MLX_TFM_KERNELS_ISA";
// Every name the switch takes, on any platform, best first.
constexpr const char* KNOWN_ISAS[] = {"avx512", "avx2", "generic"};

struct InstructionSet {
  const char* name;
  const char* description;  // for the message when the CPU lacks it
  bool (*cpu_runs)();
  const Kernels& (*kernels)();
};

#if defined(__x86_64__)
bool cpu_runs_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool cpu_runs_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

bool every_cpu_runs() { return true; }

// The sets this build holds, best first.
const InstructionSet BUILT[] = {
#if defined(__x86_64__)
    {"avx512", "AVX-512 F/BW/VL/DQ", cpu_runs_avx512, avx512::kernels},
    {"avx2", "AVX2/FMA/F16C", cpu_runs_avx2, avx2::kernels},
#endif
    {"generic", "portable loops", every_cpu_runs, generic::kernels},
};

std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

struct Choice {
  const Kernels* kernels;
  std::string error;  // empty when the request is one this CPU runs
};

Choice choose(const std::string& requested) {
  const std::vector<std::string> runnable = runnable_isas();
  const InstructionSet* best = nullptr;
  for (const InstructionSet& set : BUILT)
    if (!best && set.cpu_runs()) best = &set;
  if (requested.empty()) return {&best->kernels(), ""};
  for (const InstructionSet& set : BUILT)
    if (requested == set.name && set.cpu_runs()) return {&set.kernels(), ""};
  const std::string asked = std::string(ISA_VARIABLE) + "=" + requested;
  if (std::find(std::begin(KNOWN_ISAS), std::end(KNOWN_ISAS), requested) == std::end(KNOWN_ISAS)) {
    return {&best->kernels(), asked + " is not an instruction set mlx_tfm's kernels know: use avx512, avx2 or "
                              "generic, or leave it unset for the best this CPU runs"};
  }
  std::string what = requested;
  for (const InstructionSet& set : BUILT)
    if (requested == set.name) what = set.description;
  return {&best->kernels(), asked + ": this CPU lacks " + what + " (it runs " + joined(runnable) + ")"};
}

const Choice& choice() {
  static const Choice chosen = [] {
    const char* requested = std::getenv(ISA_VARIABLE);
    return choose(requested ? requested : "");
  }();
  return chosen;
}

}  // namespace

std::vector<std::string> runnable_isas() {
  std::vector<std::string> names;
  for (const InstructionSet& set : BUILT)
    if (set.cpu_runs()) names.push_back(set.name);
  return names;
}

const std::string& isa_request_error() { return choice().error; }

const Kernels& best_kernels() {
  if (!choice().error.empty()) throw std::invalid_argument(choice().error);
  return *choice().kernels;
}

void arrange_for_nibbles(const float* x, float* out, int64_t m, int64_t k, int lanes) {
  const int64_t block = 2 * lanes;
  for (int64_t m0 = 0; m0 < m; m0 += MAX_POSITIONS) {
    const int64_t chunk = std::min<int64_t>(MAX_POSITIONS, m - m0);
    for (int64_t i = 0; i < chunk; ++i) {
      const float* row = x + (m0 + i) * k;
      for (int64_t start = 0; start < k; start += block) {
        float* to = out + m0 * k + ((start / block) * chunk + i) * block;
        for (int j = 0; j < lanes; ++j) {
          to[j] = row[start + 2 * j];
          to[lanes + j] = row[start + 2 * j + 1];
        }
      }
    }
  }
}

int64_t attention_items(const AttentionProblem& p) {
  const int64_t pairs = p.batch * p.kv_heads;
  return p.queries == 1 ? pairs : pairs * ((p.queries + p.block_queries - 1) / p.block_queries);
}

int64_t attention_scratch(const AttentionProblem& p) {
  const int64_t group = p.heads / p.kv_heads;
  if (p.queries == 1) return group * p.positions;
  const int64_t padded = (p.positions + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  return group * p.block_queries * padded + KEY_TILE * p.head_dim;
}

}  // namespace mlx_tfm_kernels
