// The compact-precision row update of the sharded embedding engine in one pass:
// `training.ctr.kernels.subtract_rows` (see there for why it is written by hand).
//
// For each updated row it decodes the stored row to fp32, subtracts the update, draws the
// row's rounding bits (SplitMix64 keyed by seed, step and global row, exactly as
// `training.ctr.embedding.rounding_bits`) and stores the value rounded stochastically
// (`stochastic_round` for fp16 / bf16, `quantize_int8` with the kept grid for int8).
// Every operation is the one the torch path performs, in the same order and in fp32,
// and the build turns off floating-point contraction (no fused multiply-adds), so both
// paths give bitwise the same rows. Rows are independent: a parallel loop over them is
// deterministic.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Rows ahead whose memory is requested early: the rows are scattered over the table, and
// without it each row's compute waits for its cache miss (2.8 ms instead of 0.9 for 16k
// fp16 rows of a 1M-row table here).
constexpr int64_t kPrefetchRows = 16;

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;
constexpr uint64_t kRoundingDomain = 0x5352;
constexpr float kInt8Levels = 255.0f;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// A row's 16 random bits per column: column c is lane c % 4 (little-endian) of the
// row's word c / 4, one SplitMix64 hash per word.
inline void draw_row(uint64_t row_key, int64_t dim, int32_t* bits) {
  for (int64_t word = 0; word * 4 < dim; ++word) {
    const uint64_t z = mix64(row_key + static_cast<uint64_t>(word + 1) * kGamma);
    for (int64_t lane = 0; lane < 4 && word * 4 + lane < dim; ++lane) {
      bits[word * 4 + lane] = static_cast<int32_t>((z >> (16 * lane)) & 0xFFFFu);
    }
  }
}

inline c10::Half round_half(float x, int32_t bits) {
  if (std::fabs(x) < 0x1p-14f) {  // fp16's subnormals: on the value line, 2**-24 apart
    const float scaled = x * 16777216.0f;
    const float down = std::floor(scaled);
    const bool up = (scaled - down) * 65536.0f > static_cast<float>(bits);
    return c10::Half((up ? down + 1.0f : down) * 0x1p-24f);
  }
  const uint32_t noise = static_cast<uint32_t>(bits >> 3);  // 13 bits
  return c10::Half(bits_float((float_bits(x) + noise) & 0xFFFFE000u));  // exact
}

inline c10::BFloat16 round_bfloat16(float x, int32_t bits) {
  const uint32_t rounded = (float_bits(x) + static_cast<uint32_t>(bits)) & 0xFFFF0000u;
  return c10::BFloat16(static_cast<uint16_t>(rounded >> 16), c10::BFloat16::from_bits());
}

template <typename T, typename Round>
void update_rows(torch::Tensor& weight, const torch::Tensor& rows, const torch::Tensor& update,
                 int64_t world_size, int64_t rank, uint64_t stream, Round round) {
  const int64_t dim = weight.size(1);
  T* table = weight.data_ptr<T>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const float* delta = update.data_ptr<float>();
  at::parallel_for(0, rows.size(0), 256, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> bits(dim);
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetchRows < end) __builtin_prefetch(table + row[i + kPrefetchRows] * dim, 1);
      T* values = table + row[i] * dim;
      const uint64_t global = static_cast<uint64_t>(row[i] * world_size + rank);
      draw_row(mix64(global * kGamma + stream), dim, bits.data());
      for (int64_t c = 0; c < dim; ++c) {
        const float x = static_cast<float>(values[c]) - delta[i * dim + c];
        values[c] = round(x, bits[c]);
      }
    }
  });
}

void update_int8_rows(torch::Tensor& codes, torch::Tensor& scale_bias, const torch::Tensor& rows,
                      const torch::Tensor& update, int64_t world_size, int64_t rank,
                      uint64_t stream) {
  const int64_t dim = codes.size(1);
  uint8_t* table = codes.data_ptr<uint8_t>();
  float* grids = scale_bias.data_ptr<float>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const float* delta = update.data_ptr<float>();
  at::parallel_for(0, rows.size(0), 256, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    std::vector<int32_t> bits(dim);
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetchRows < end) {
        __builtin_prefetch(table + row[i + kPrefetchRows] * dim, 1);
        __builtin_prefetch(grids + row[i + kPrefetchRows] * 2, 1);
      }
      uint8_t* code = table + row[i] * dim;
      float* grid = grids + row[i] * 2;
      const float scale = grid[0], bias = grid[1];
      float lo = INFINITY, hi = -INFINITY;
      for (int64_t c = 0; c < dim; ++c) {
        const float decoded = static_cast<float>(code[c]) * scale;
        x[c] = (decoded + bias) - delta[i * dim + c];
        lo = std::min(lo, x[c]);
        hi = std::max(hi, x[c]);
      }
      // Keep the grid while the row's values lie inside it, else re-grid on them.
      const float top = bias + kInt8Levels * scale;
      const bool fits = scale > 0.0f && lo >= bias && hi <= top;
      const float new_scale = fits ? scale : (hi - lo) / kInt8Levels;
      const float new_bias = fits ? bias : lo;
      const float safe = new_scale > 0.0f ? new_scale : 1.0f;
      const uint64_t global = static_cast<uint64_t>(row[i] * world_size + rank);
      draw_row(mix64(global * kGamma + stream), dim, bits.data());
      for (int64_t c = 0; c < dim; ++c) {
        const float steps = (x[c] - new_bias) / safe;
        const float fraction = static_cast<float>(bits[c]) * 0x1p-16f;
        const float level = std::floor(steps + fraction);
        code[c] = static_cast<uint8_t>(std::min(std::max(level, 0.0f), kInt8Levels));
      }
      grid[0] = new_scale;
      grid[1] = new_bias;
    }
  });
}

// weight[rows] -= update, rounded stochastically; see the file's comment.
void subtract_rows(torch::Tensor weight, c10::optional<torch::Tensor> scale_bias,
                   torch::Tensor rows, torch::Tensor update, int64_t world_size, int64_t rank,
                   int64_t seed, int64_t step) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous (N, D)");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.is_contiguous(), "rows: int64");
  TORCH_CHECK(update.scalar_type() == torch::kFloat32 && update.is_contiguous() &&
                  update.dim() == 2 && update.size(0) == rows.size(0) &&
                  update.size(1) == weight.size(1),
              "update must be a contiguous float32 (R, D)");
  const int64_t n = weight.size(0);
  if (rows.numel()) {
    TORCH_CHECK(rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < n,
                "rows out of the table");
  }
  // `rounding_bits`' stream: SplitMix64 of (seed, domain), then of the step.
  const uint64_t stream =
      mix64(mix64(static_cast<uint64_t>(seed) ^ kRoundingDomain) + static_cast<uint64_t>(step) * kGamma);
  switch (weight.scalar_type()) {
    case torch::kHalf:
      update_rows<c10::Half>(weight, rows, update, world_size, rank, stream, round_half);
      break;
    case torch::kBFloat16:
      update_rows<c10::BFloat16>(weight, rows, update, world_size, rank, stream, round_bfloat16);
      break;
    case torch::kByte: {
      TORCH_CHECK(scale_bias.has_value(), "int8 rows need their scale_bias");
      torch::Tensor grid = scale_bias.value();
      TORCH_CHECK(grid.scalar_type() == torch::kFloat32 && grid.is_contiguous() &&
                      grid.size(0) == n && grid.size(1) == 2,
                  "scale_bias must be a contiguous float32 (N, 2)");
      update_int8_rows(weight, grid, rows, update, world_size, rank, stream);
      break;
    }
    default:
      TORCH_CHECK(false, "subtract_rows updates float16, bfloat16 or uint8 rows");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("subtract_rows", &subtract_rows, "Stochastically rounded row update (see rounding.cpp)");
}
