// What a snapshot was made from, and whether a run may continue or score it: the model's shape,
// the tokenizer and the data, recorded by the trainer's snapshots and checked by resume, eval,
// generate and export. A room of its own so that train/ and use/ both reach it without one
// depending on the other.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/recipe/recipe.h"

namespace t3d::runtime {

// UserError unless `now` has the [model] shape (every key that changes the tensors) of the
// recipe stored in snapshot `path`, naming the key and where `now` got it: every verb that reads a
// snapshot restores or scores exactly the model it holds. `verb`: "resume from", "evaluate"...
void check_same_model(const std::string& saved_toml, const Recipe& now, const std::string& path,
                      const std::string& verb);

// The [model] keys that change what a snapshot's weights compute without changing a tensor
// (RoPE's base and scaling keys, the norms' epsilon, the routing: experts_per_token, router_score,
// router_norm_topk, router_scale, capacity_factor, and router_bias_rate where the snapshot has a
// selection bias), each "model.KEY: SAVED in the snapshot, NOW in this run (WHERE)"
// where `now` differs from the stored recipe. A resume or eval may change them on purpose (a
// longer RoPE base, another top-k); the caller says so once (rank 0).
std::vector<std::string> changed_model_function(const std::string& saved_toml, const Recipe& now,
                                                const std::string& path);

// The recipe stored in a snapshot, with `overrides` applied and snapshot.resume set to the
// snapshot: what `titan3d resume` runs. UserError naming the file if it is not a snapshot.
Recipe load_resume_recipe(const std::string& snapshot, const std::vector<Override>& overrides);

// The tokenizer travels with a snapshot as its path (data.tokenizer in the stored recipe) plus the
// content hash of the model file, the index counter kTokenizerHashCounter (absent for "bytes").
inline constexpr const char* kTokenizerHashCounter = "tokenizer_hash";
// hash64 of `recipe`'s tokenizer model file, as stored in the counter (0 for "bytes").
int64_t tokenizer_hash(const Recipe& recipe);
// UserError unless `now`'s data.tokenizer is the tokenizer the snapshot at `path` was made with:
// "bytes" for both, or a model file whose content hash is the recorded one. `counters` are the
// snapshot's index counters.
void check_same_tokenizer(const std::map<std::string, int64_t>& counters, const Recipe& now,
                          const std::string& path, const std::string& verb);

// The training data's content hash (data.path's file; for a pattern of shards, the hash of their
// hashes in order) is recorded as the index counter
// kDataHashCounter. A resume of a snapshot whose data.path is the same but whose content changed
// says so (rank 0, a warning): the continuation is not the run that would have happened.
inline constexpr const char* kDataHashCounter = "data_hash";
int64_t data_hash(const Recipe& recipe);  // 0 when data.path names no readable file
void warn_if_data_changed(const std::map<std::string, int64_t>& counters,
                          const std::string& saved_toml, const Recipe& now,
                          const std::string& path);

}  // namespace t3d::runtime
