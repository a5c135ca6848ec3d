// The config.json keys `titan3d import` knows, family by family: each is mapped to a recipe key,
// checked against what titan3d represents, or known to change nothing the model computes
// (metadata, inference settings). Any other key is refused by name: a key the importer does not
// know may change the model (a quantization_config, a sliding window), and ignoring it would
// import a model that silently differs from its definition.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "runtime/use/export.h"

namespace t3d::runtime {

// UserError naming `src` and the first key of config.json `c` that family `layout` neither maps,
// checks nor knows to be without effect, saying what to do.
void refuse_unknown_config_keys(const nlohmann::json& c, const std::string& src, HfLayout layout);

}  // namespace t3d::runtime
