// What the recipe's own files share, not for other rooms: the schema (recipe_schema.cpp: every key
// once, its type, default, meaning, and how it reads and writes TOML), the located error every
// file raises, and validation (recipe_check.cpp), which parse_recipe (recipe.cpp) runs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <toml.hpp>
#include <vector>

#include "runtime/recipe/recipe.h"

namespace t3d::runtime::recipe_detail {

// "recipe.toml:12" or "--set parallel.tp=3": where a value was read, for messages.
std::string where(const toml::value& v);

// UserError "recipe error: <origin>: `<key>`: <msg>".
[[noreturn]] void fail(const std::string& origin, const std::string& key, const std::string& msg);

// The most layers a model may have (docs/recipe.md, "Limits"); every:K recomputes at most that.
constexpr int64_t kMaxLayers = int64_t{1} << 14;

// One recipe key: its section, name, TOML type and meaning, and how it reads into and writes from
// a Recipe.
struct Field {
  std::string section, key, type, meaning;
  std::function<void(Recipe&, const toml::value&)> read;  // throws UserError on a wrong type
  std::function<std::string(const Recipe&)> write;        // value as a TOML literal
  std::string full() const { return section + "." + key; }
};

// Every key, section by section in the order a recipe is written back and `titan3d keys` lists.
const std::vector<Field>& schema();

// Values and their combinations (UserError naming the key and where it was set); dp = -1 leaves
// what needs dp to Recipe::resolve_world.
void validate(const Recipe& r);

}  // namespace t3d::runtime::recipe_detail
