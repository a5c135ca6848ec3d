// config.json's RoPE scaling both ways: transformers' `rope_scaling` object as the [model] rope_*
// keys (`titan3d import`) and back (`titan3d export`), so that a round trip keeps it exactly.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// Sets m's rope_scaling keys from config.json `c`'s `rope_scaling`: absent, null or of rope_type
// "default": none. Its kind is `rope_type` (or the older `type`; both must then agree): "linear"
// (`factor`) or "llama3" (`factor`, `low_freq_factor`, `high_freq_factor`,
// `original_max_position_embeddings`). Every key of the object is one of the kind's or refused;
// a missing or mistyped one, a value out of range and another kind (dynamic, yarn...) are
// UserErrors naming `src` and the key. Also refuses `partial_rotary_factor` other than 1 (titan3d
// rotates whole heads).
void rope_scaling_from_config(const nlohmann::json& c, const std::string& src, ModelConfig& m);

// The JSON value export writes as `rope_scaling`: null, or the object above with `rope_type`,
// its numbers written so that rope_scaling_from_config reads the same doubles back.
std::string rope_scaling_json(const ModelConfig& m);

}  // namespace t3d::runtime
