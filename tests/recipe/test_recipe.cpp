// Recipe parsing and validation: defaults, overrides, located errors, suggestions, round trip.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "kernels/check.h"
#include "runtime/recipe/recipe.h"

using namespace t3d::runtime;
namespace fs = std::filesystem;

namespace {
// The UserError message of parsing `text`, or "" if it parsed.
std::string error_of(const std::string& text, const std::vector<Override>& sets = {}) {
  try {
    parse_recipe(text, "r.toml", sets);
  } catch (const t3d::UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Recipe, EveryShippedRecipeParses) {
  int count = 0;
  for (const auto& entry : fs::directory_iterator(T3D_SOURCE_DIR "/recipes")) {
    if (entry.path().extension() != ".toml") continue;
    SCOPED_TRACE(entry.path().string());
    EXPECT_NO_THROW(load_recipe(entry.path().string()));
    ++count;
  }
  EXPECT_GE(count, 3);
}

TEST(Recipe, DefaultsAndDerivedValues) {
  const Recipe r = parse_recipe("[model]\ndim = 96\nn_heads = 6\n", "r.toml");
  EXPECT_EQ(r.model.n_kv_heads, 6);
  EXPECT_EQ(r.model.ffn_dim, 256);  // 8/3·96 = 256, already a multiple of 64
  EXPECT_EQ(r.run.dir, "runs/titan3d");
  EXPECT_EQ(r.snapshot.dir, "runs/titan3d/snapshots");
  EXPECT_EQ(r.world_size(), 1);
}

TEST(Recipe, OverridesReplaceFileValuesAndCreateSections) {
  const Recipe r =
      parse_recipe("[parallel]\ntp = 1\n", "r.toml",
                   {parse_override("parallel.tp=2"), parse_override("train.steps=20"),
                    parse_override("run.dir=/tmp/x y"), parse_override("train.lr=1e-3")});
  EXPECT_EQ(r.parallel.tp, 2);
  EXPECT_EQ(r.train.steps, 20);
  EXPECT_EQ(r.run.dir, "/tmp/x y");
  EXPECT_DOUBLE_EQ(r.train.lr, 1e-3);
  EXPECT_NE(error_of("", {parse_override("parallel.tp=3")}).find("--set parallel.tp=3"),
            std::string::npos);
  EXPECT_THROW(parse_override("parallel.tp"), t3d::UserError);
}

TEST(Recipe, UnknownKeysAreErrorsWithSuggestions) {
  EXPECT_NE(error_of("[paralel]\ntp = 2\n").find("Did you mean `parallel.tp`"), std::string::npos);
  EXPECT_NE(error_of("[train]\nstesp = 2\n").find("Did you mean `train.steps`"), std::string::npos);
  EXPECT_NE(error_of("[train]\nzzzzzzzz = 2\n").find("unknown key"), std::string::npos);
  EXPECT_EQ(closest_key("model.n_layer"), "model.n_layers");
  EXPECT_EQ(closest_key("completely.unrelated.thing"), "");
}

TEST(Recipe, ErrorsNameFileLineAndKey) {
  const std::string e = error_of("[model]\ndim = 64\n\n[parallel]\ntp = 3\n");
  EXPECT_NE(e.find("r.toml:5"), std::string::npos) << e;
  EXPECT_NE(e.find("`parallel.tp`"), std::string::npos) << e;
  const std::string t = error_of("[train]\nlr = \"fast\"\n");
  EXPECT_NE(t.find("r.toml:2"), std::string::npos) << t;
  EXPECT_NE(t.find("expected float"), std::string::npos) << t;
}

TEST(Recipe, ImpossibleCombinationsAreRejected) {
  EXPECT_NE(error_of("[model]\nn_layers = 2\n[parallel]\npp = 3\n").find("parallel.pp"),
            std::string::npos);
  EXPECT_NE(error_of("[model]\nn_heads = 8\nn_kv_heads = 3\n").find("model.n_kv_heads"),
            std::string::npos);
  EXPECT_NE(error_of("[train]\nglobal_batch = 6\nmicro_batches = 4\n").find("train.global_batch"),
            std::string::npos);
  EXPECT_NE(error_of("[parallel]\nvirtual_stages = 2\n").find("interleaved_1f1b"),
            std::string::npos);
  EXPECT_NE(error_of("[parallel]\npp = 2\npipeline_split = [3, 1]\n").find("pipeline_split"),
            std::string::npos);
  EXPECT_NE(error_of("[model]\nseq_len = 30\n[parallel]\ncp = 4\n").find("parallel.cp"),
            std::string::npos);
  EXPECT_EQ(error_of("[model]\nseq_len = 32\n[parallel]\ncp = 4\n"), "");
  EXPECT_NE(error_of("[train]\nactivation_checkpoint = \"every:0\"\n").find("every:K"),
            std::string::npos);
  EXPECT_NE(error_of("[train]\nprecision = \"fp16\"\n").find("fp32, bf16"), std::string::npos);
  EXPECT_EQ(error_of("[train]\nactivation_checkpoint = \"every:2\"\n"), "");
  EXPECT_NE(error_of("[data]\nbos = true\n").find("data.bos"), std::string::npos);
  EXPECT_EQ(error_of("[data]\nbos = true\ntokenizer = \"t.model\"\n"), "");
}

// Each enumerated key parses every spelling of its table into its value, writes it back the same,
// and refuses anything else naming the key, the file and line, and every spelling.
template <typename E, typename Get>
void expect_every_spelling(const std::string& section, const std::string& key, Get get,
                           const std::string& extra = "", const std::string& in_section = "") {
  for (const auto& [value, name] : Choices<E>::kAll) {
    const std::string text =
        extra + "[" + section + "]\n" + in_section + key + " = \"" + std::string(name) + "\"\n";
    const Recipe r = parse_recipe(text, "r.toml");
    EXPECT_EQ(get(r), value) << text;
    EXPECT_EQ(get(parse_recipe(r.to_toml(), "again.toml")), value) << name;
    EXPECT_NE(r.to_toml().find(key + " = \"" + std::string(name) + "\"\n"), std::string::npos);
  }
  const std::string head = extra + "[" + section + "]\n" + in_section;
  const std::string e = error_of(head + key + " = \"nonsense\"\n");
  EXPECT_NE(e.find("r.toml:"), std::string::npos) << e;
  EXPECT_NE(
      e.find("`" + section + "." + key + "`: \"nonsense\" is not one of: " + choice_list<E>()),
      std::string::npos)
      << e;
  EXPECT_NE(error_of(head + key + " = 3\n").find("expected string"), std::string::npos);
}

TEST(Recipe, EnumeratedKeysParseEverySpellingOnce) {
  expect_every_spelling<TrainPrecision>("train", "precision",
                                        [](const Recipe& r) { return r.train.precision; });
  expect_every_spelling<GemmLibrary>("hardware", "gemm",
                                     [](const Recipe& r) { return r.hardware.gemm; });
  expect_every_spelling<DataFormat>("data", "format",
                                    [](const Recipe& r) { return r.data.format; });
  expect_every_spelling<SampleMode>("data", "sampler",
                                    [](const Recipe& r) { return r.data.sampler; });
  // pp = 2 and 4 micro-batches: every schedule's combination checks pass.
  expect_every_spelling<t3d::parallel::ScheduleKind>(
      "parallel", "schedule", [](const Recipe& r) { return r.parallel.schedule; },
      "[model]\nn_layers = 8\n[train]\nmicro_batches = 4\n", "pp = 2\n");
  EXPECT_EQ(choice_list<SampleMode>(), "random, sequential");
  expect_every_spelling<t3d::kernels::RopeScaling::Kind>(
      "model", "rope_scaling", [](const Recipe& r) { return r.model.rope_scaling; });
  // hardware.device = "auto": "nccl" is refused on a CPU device (below).
  expect_every_spelling<DeviceComm>(
      "parallel", "device_comm", [](const Recipe& r) { return r.parallel.device_comm; },
      "[hardware]\ndevice = \"auto\"\n");
}

// parallel.device_comm = "nccl" moves tensors between GPUs: refused where hardware.device is the
// CPU, naming both keys; auto and staged run anywhere (a CPU rank's collectives stay on MPI).
TEST(Recipe, NcclDeviceCommNeedsAGpuDevice) {
  const std::string e = error_of("[parallel]\ndevice_comm = \"nccl\"\n");
  EXPECT_NE(e.find("parallel.device_comm"), std::string::npos) << e;
  EXPECT_NE(e.find("hardware.device = \"cpu\""), std::string::npos) << e;
  EXPECT_EQ(error_of("[parallel]\ndevice_comm = \"nccl\"\n[hardware]\ndevice = \"cuda\"\n"), "");
  EXPECT_EQ(error_of("[parallel]\ndevice_comm = \"staged\"\n"), "");
  EXPECT_EQ(parse_recipe("", "r.toml").parallel.device_comm, DeviceComm::kAuto);
}

// model.head_dim: 0 derives dim / n_heads (which must then divide); another even value is every
// head's width whatever dim is, and an odd one is refused naming the key.
TEST(Recipe, HeadDimIsDerivedOrExplicit) {
  EXPECT_EQ(parse_recipe("[model]\ndim = 64\nn_heads = 4\n", "r.toml").model.head_dim(), 16);
  const Recipe qwen3 =
      parse_recipe("[model]\ndim = 64\nn_heads = 6\nn_kv_heads = 2\nhead_dim = 24\n", "r.toml");
  EXPECT_EQ(qwen3.model.head_dim(), 24);
  EXPECT_EQ(qwen3.model.attention_width(), 144);
  EXPECT_EQ(parse_recipe(qwen3.to_toml(), "again.toml").model.head_dim(), 24);
  const std::string odd = error_of("[model]\ndim = 64\nn_heads = 4\nhead_dim = 7\n");
  EXPECT_NE(odd.find("`model.head_dim`: must be even"), std::string::npos) << odd;
  EXPECT_NE(error_of("[model]\nhead_dim = -2\n").find("`model.head_dim`"), std::string::npos);
  const std::string indivisible = error_of("[model]\ndim = 64\nn_heads = 6\n");
  EXPECT_NE(indivisible.find("`model.n_heads`"), std::string::npos) << indivisible;
  EXPECT_NE(indivisible.find("set model.head_dim"), std::string::npos) << indivisible;
  EXPECT_NE(error_of("[model]\nhead_dim = 262144\n").find("`model.head_dim`"), std::string::npos);
}

// RoPE scaling: each kind's parameters in range, a parameter the kind does not read refused
// unless at its default (named, with the kind), and the recipe's keys carried to the kernels'
// struct.
TEST(Recipe, RopeScalingKeysAreCheckedForTheirKind) {
  const Recipe r = parse_recipe(
      "[model]\nrope_scaling = \"llama3\"\nrope_factor = 32.0\nrope_low_freq_factor = 1.5\n"
      "rope_high_freq_factor = 4.5\nrope_original_seq_len = 64\n",
      "r.toml");
  const t3d::kernels::RopeScaling s = r.model.rope();
  EXPECT_EQ(s.kind, t3d::kernels::RopeScaling::Kind::kLlama3);
  EXPECT_EQ(s.factor, 32.0);
  EXPECT_EQ(s.low_freq_factor, 1.5);
  EXPECT_EQ(s.high_freq_factor, 4.5);
  EXPECT_EQ(s.original_context, 64.0);
  EXPECT_EQ(parse_recipe(r.to_toml(), "again.toml").to_toml(), r.to_toml());
  EXPECT_EQ(parse_recipe("", "d.toml").model.rope().kind, t3d::kernels::RopeScaling::Kind::kNone);
  const std::pair<std::string, std::string> bad[] = {
      {"rope_factor = 2.0\n", "model.rope_factor"},  // none reads no factor
      {"rope_scaling = \"linear\"\nrope_factor = 0.0\n", "model.rope_factor"},
      {"rope_scaling = \"linear\"\nrope_factor = -2.0\n", "model.rope_factor"},
      {"rope_scaling = \"linear\"\nrope_low_freq_factor = 2.0\n", "model.rope_low_freq_factor"},
      {"rope_high_freq_factor = 8.0\n", "model.rope_high_freq_factor"},
      {"rope_original_seq_len = 4096\n", "model.rope_original_seq_len"},
      {"rope_scaling = \"llama3\"\nrope_low_freq_factor = 0.0\n", "model.rope_low_freq_factor"},
      {"rope_scaling = \"llama3\"\nrope_high_freq_factor = 1.0\n", "model.rope_high_freq_factor"},
      {"rope_scaling = \"llama3\"\nrope_original_seq_len = 0\n", "model.rope_original_seq_len"},
  };
  for (const auto& [text, key] : bad) {
    const std::string e = error_of("[model]\n" + text);
    EXPECT_NE(e.find("`" + key + "`"), std::string::npos) << text << ": " << e;
    EXPECT_NE(e.find("r.toml:"), std::string::npos) << e;
  }
  EXPECT_NE(error_of("[model]\nrope_factor = 2.0\n").find("model.rope_scaling = \"none\""),
            std::string::npos);
  EXPECT_EQ(error_of("[model]\nrope_scaling = \"linear\"\nrope_factor = 4.0\n"), "");
}

TEST(Recipe, ActivationCheckpointSpellings) {
  for (const auto& [text, every] :
       std::vector<std::pair<std::string, int64_t>>{{"none", 0}, {"full", 1}, {"every:3", 3}}) {
    const Recipe r = parse_recipe("[train]\nactivation_checkpoint = \"" + text + "\"\n", "r.toml");
    EXPECT_EQ(r.train.activation_checkpoint.every, every) << text;
    EXPECT_EQ(r.train.activation_checkpoint.name(), text);
    EXPECT_EQ(parse_recipe(r.to_toml(), "again.toml").train.activation_checkpoint.every, every);
  }
  for (const char* bad : {"every:", "every:0", "every:x", "every:-1", "every:16385", "some"})
    EXPECT_NE(error_of(std::string("[train]\nactivation_checkpoint = \"") + bad + "\"\n")
                  .find("`train.activation_checkpoint`: \"" + std::string(bad) +
                        "\" is not one of: none, full, every:K"),
              std::string::npos)
        << bad;
}

TEST(Recipe, ZbVImpliesTwoVirtualStages) {
  // Left out, virtual_stages follows the schedule; said otherwise, it is a contradiction.
  const Recipe r = parse_recipe("[parallel]\npp = 2\nschedule = \"zb_v\"\n", "r.toml");
  EXPECT_EQ(r.parallel.virtual_stages, 2);
  EXPECT_EQ(parse_recipe(r.to_toml(), "again.toml").parallel.virtual_stages, 2);
  EXPECT_EQ(error_of("[parallel]\npp = 2\nschedule = \"zb_v\"\nvirtual_stages = 2\n"), "");
  for (const char* v : {"1", "3"}) {
    const std::string e = error_of(
        std::string("[parallel]\npp = 2\nschedule = \"zb_v\"\nvirtual_stages = ") + v + "\n");
    EXPECT_NE(e.find("`parallel.virtual_stages`"), std::string::npos) << e;
    EXPECT_NE(e.find("contradicts parallel.schedule = \"zb_v\""), std::string::npos) << e;
  }
  const std::string one = error_of("[parallel]\nschedule = \"zb_v\"\n");
  EXPECT_NE(one.find("`parallel.schedule`: zb_v needs parallel.pp ≥ 2"), std::string::npos) << one;
  // Two chunks per stage: 4 layers are too few for pp = 3.
  EXPECT_NE(error_of("[model]\nn_layers = 4\n[parallel]\npp = 3\nschedule = \"zb_v\"\n")
                .find("pp·virtual_stages = 6"),
            std::string::npos);
}

// A stored recipe (a snapshot's, restart.toml) derives run.dir, snapshot.dir and virtual_stages
// anew from what a resume's overrides change, also one stored with them resolved (older
// snapshots): read back through to_toml, as `resume` does.
TEST(Recipe, StoredRecipeDerivesWhatOverridesChange) {
  const Recipe a = parse_recipe("[run]\nname = \"a\"\n[model]\nn_layers = 4\n", "a.toml");
  EXPECT_EQ(a.snapshot.dir, "runs/a/snapshots");
  const std::string resolved_long_ago =
      "[run]\nname = \"a\"\ndir = \"runs/a\"\n[model]\nn_layers = 4\n[parallel]\n"
      "virtual_stages = 1\n[snapshot]\ndir = \"runs/a/snapshots\"\n";
  for (const std::string& stored :
       {a.to_toml(), parse_recipe(resolved_long_ago, "old.toml").to_toml()}) {
    const Recipe b = parse_recipe(stored, "stored", {{"run.dir", "runs/b"}});
    EXPECT_EQ(b.run.dir, "runs/b");
    EXPECT_EQ(b.snapshot.dir, "runs/b/snapshots") << stored;
    const Recipe z =
        parse_recipe(stored, "stored", {{"parallel.pp", "2"}, {"parallel.schedule", "zb_v"}});
    EXPECT_EQ(z.parallel.virtual_stages, 2);
    EXPECT_EQ(parse_recipe(stored, "stored").snapshot.dir, "runs/a/snapshots");
  }
  // A value set apart from what is derived stays as set.
  const Recipe own =
      parse_recipe("[run]\nname = \"a\"\n[snapshot]\ndir = \"/x/snaps\"\n", "own.toml");
  EXPECT_EQ(parse_recipe(own.to_toml(), "stored", {{"run.dir", "runs/b"}}).snapshot.dir,
            "/x/snaps");
}

TEST(Recipe, WorldResolution) {
  Recipe r =
      parse_recipe("[parallel]\npp = 2\ndp = -1\ntp = 2\n[train]\nglobal_batch = 12\n", "r.toml");
  r.resolve_world(12);
  EXPECT_EQ(r.parallel.dp, 3);
  Recipe bad = parse_recipe("[parallel]\npp = 2\ndp = -1\ntp = 2\n", "r.toml");
  EXPECT_THROW(bad.resolve_world(6), t3d::UserError);  // 6 is not a multiple of pp·tp = 4
  Recipe fixed = parse_recipe("[parallel]\npp = 2\ndp = 2\ntp = 2\n", "r.toml");
  try {
    fixed.resolve_world(4);
    FAIL() << "world of 4 accepted for an 8-rank recipe";
  } catch (const t3d::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("= 8 ranks but the launcher started 4"), std::string::npos)
        << e.what();
  }
}

// parallel.ep must divide dp·cp also when dp = -1 is resolved from the world (the other ep rules
// are bad recipes in tests/e2e/bad_recipes).
TEST(Recipe, ExpertParallelismFoldsIntoTheResolvedDp) {
  const std::string moe = "[model]\nn_experts = 4\n[parallel]\ndp = -1\nep = 2\n";
  Recipe r = parse_recipe(moe, "r.toml");
  r.resolve_world(4);
  EXPECT_EQ(r.parallel.dp, 4);
  Recipe bad = parse_recipe(moe + "[train]\nglobal_batch = 9\n", "r.toml");
  try {
    bad.resolve_world(3);
    FAIL() << "ep = 2 accepted on dp = 3";
  } catch (const t3d::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("`parallel.ep`: ep = 2 does not divide dp·cp = 3·1"),
              std::string::npos)
        << e.what();
  }
}

TEST(Recipe, ToTomlRoundTripsEveryKey) {
  const Recipe r = parse_recipe(
      "[model]\ndim = 128\nn_heads = 4\nrope_theta = 500000.0\n[parallel]\npp = 2\n"
      "pipeline_split = [1]\n[run]\nname = \"a \\\"quoted\\\" name\"\n[train]\nlr = 0.1\n",
      "r.toml");
  const Recipe again = parse_recipe(r.to_toml(), "round-trip.toml");
  EXPECT_EQ(again.to_toml(), r.to_toml());
  EXPECT_EQ(again.run.name, "a \"quoted\" name");
  EXPECT_EQ(again.parallel.pipeline_split, std::vector<int64_t>{1});
  EXPECT_DOUBLE_EQ(again.train.lr, 0.1);
}

// Control characters, quotes and backslashes in string values survive to_toml (the recipe a
// snapshot stores) and parse back unchanged: otherwise the snapshot could never be resumed.
TEST(Recipe, ToTomlEscapesControlCharacters) {
  Recipe r = parse_recipe("", "defaults.toml");
  r.run.name = std::string(
                   "a\nb\tc\rd\x01"
                   "e\x1f\x7f\"q\"\\z'") +
               '\0' + "end";
  r.data.path = "/tmp/it's \"here\"\n";
  const Recipe again = parse_recipe(r.to_toml(), "escaped.toml");
  EXPECT_EQ(again.run.name, r.run.name);
  EXPECT_EQ(again.data.path, r.data.path);
  EXPECT_EQ(again.to_toml(), r.to_toml());
}

// A path spliced into a recipe as a value (`titan3d resume <path>`) is taken as that exact string,
// whatever TOML syntax it contains.
TEST(Recipe, TomlStringQuotesAnyPath) {
  for (const std::string path :
       {"/tmp/it's/step.h5", "a\"b", "x\\y", "true", "123", "[1]", "'''", "p\nq", "#c = d"}) {
    const Recipe r = parse_recipe("", "r.toml", {{"snapshot.resume", toml_string(path)}});
    EXPECT_EQ(r.snapshot.resume, path);
  }
}

TEST(Recipe, DocsListEveryKey) {
  std::ifstream in(T3D_SOURCE_DIR "/docs/recipe.md");
  ASSERT_TRUE(in.good()) << "docs/recipe.md is missing";
  std::stringstream text;
  text << in.rdbuf();
  // Every row of `titan3d keys` (type, default and meaning from the schema) is a line of the
  // doc, so the two cannot drift apart.
  std::stringstream table(recipe_keys_table());
  std::string row;
  int rows = 0;
  while (std::getline(table, row)) {
    ++rows;
    EXPECT_NE(text.str().find("\n" + row + "\n"), std::string::npos)
        << "docs/recipe.md lacks this row of `titan3d keys` (paste it there):\n"
        << row;
  }
  EXPECT_EQ(rows, static_cast<int>(recipe_key_docs().size()) + 2);
}

// ---- Hostile values ----------------------------------------------

namespace {
// The error of one `--set`, which must name `key` ("" when it parsed).
std::string set_error(const std::string& set) { return error_of("", {parse_override(set)}); }
bool names(const std::string& error, const std::string& key) {
  return error.find("`" + key + "`") != std::string::npos;
}
}  // namespace

TEST(RecipeLimits, DeepNestingIsRefusedBeforeTheParserRecurses) {
  const int n = 20000;  // enough to overflow the stack inside toml11 without the pre-scan
  const std::string arrays = "[model]\n\nx = " + std::string(n, '[') + std::string(n, ']') + "\n";
  std::string tables = "[model]\nx = ";
  for (int i = 0; i < n; ++i) tables += "{a=";
  tables += "1" + std::string(n, '}') + "\n";
  std::string dotted = "[model]\n";
  for (int i = 0; i < n; ++i) dotted += "a.";
  dotted += "b = 1\n";
  for (const auto& text : {arrays, tables, dotted}) {
    const std::string e = error_of(text);
    EXPECT_NE(e.find("nested more than"), std::string::npos) << e.substr(0, 200);
  }
  EXPECT_NE(error_of(arrays).find("r.toml:3"), std::string::npos) << error_of(arrays);
  // Brackets inside strings and comments are not nesting; shallow nesting parses as before.
  EXPECT_EQ(error_of("[run]\nname = \"" + std::string(100, '[') + "\" # " + std::string(100, '{') +
                     "\n[parallel]\npipeline_split = []\n"),
            "");
  EXPECT_NE(set_error("parallel.pipeline_split=" + std::string(n, '[') + std::string(n, ']'))
                .find("nested more than"),
            std::string::npos);
}

TEST(RecipeLimits, IntegersBeyond64BitsAreRefusedNotClamped) {
  for (const char* v : {"99999999999999999999", "-99999999999999999999", "0xFFFFFFFFFFFFFFFFFF",
                        "9_223_372_036_854_775_808"}) {
    const std::string e = set_error(std::string("train.steps=") + v);
    EXPECT_TRUE(names(e, "train.steps")) << e;
    EXPECT_NE(e.find("does not fit in 64 bits"), std::string::npos) << e;
  }
  EXPECT_NE(error_of("[parallel]\npipeline_split = [1, 99999999999999999999]\n")
                .find("does not fit in 64 bits"),
            std::string::npos);
  EXPECT_TRUE(names(error_of("[train]\nseed = 18446744073709551616\n"), "train.seed"));
  // The limits themselves are fine values.
  EXPECT_EQ(parse_recipe("[train]\nseed = 9223372036854775807\n", "r.toml").train.seed, INT64_MAX);
  EXPECT_EQ(parse_recipe("[train]\nseed = -9223372036854775808\n", "r.toml").train.seed, INT64_MIN);
  EXPECT_EQ(parse_recipe("[train]\nseed = 0x7FFFFFFFFFFFFFFF\n", "r.toml").train.seed, INT64_MAX);
}

TEST(RecipeLimits, HugeCountsAreRefusedNamingTheKey) {
  const std::string two62 = "4611686018427387904";
  const std::pair<std::string, std::string> cases[] = {
      {"parallel.dp=" + two62, "parallel.dp"},  // dp·micro_batches overflowed to 0: SIGFPE
      {"train.global_batch=" + two62, "train.global_batch"},
      {"train.micro_batches=1099511627776", "train.micro_batches"},
      {"model.n_layers=4294967298", "model.n_layers"},
      {"parallel.virtual_stages=4611686018427387905", "parallel.virtual_stages"},
      {"model.seq_len=1000000000", "model.seq_len"},
      {"model.vocab_size=" + two62, "model.vocab_size"},
      {"model.dim=" + two62, "model.dim"},
      {"train.steps=" + two62, "train.steps"},
      {"parallel.tp=" + two62, "parallel.tp"},
      {"train.val_batches=" + two62, "train.val_batches"},
      {"train.activation_checkpoint=\"every:99999999999999999999\"", "train.activation_checkpoint"},
      {"train.activation_checkpoint=\"every:0\"", "train.activation_checkpoint"},
  };
  for (const auto& [set, key] : cases) EXPECT_TRUE(names(set_error(set), key)) << set_error(set);
  // Each factor within bounds, their product not.
  EXPECT_TRUE(names(error_of("[parallel]\npp = 1024\ndp = 1024\ntp = 2\n"), "parallel.dp"));
  EXPECT_TRUE(names(error_of("[model]\nseq_len = 16777216\n[train]\nglobal_batch = 8192\n"),
                    "train.global_batch"));
  EXPECT_TRUE(names(error_of("[model]\nseq_len = 1048576\n[train]\nglobal_batch = 64\n"),
                    "train.global_batch"));  // activations of one micro-batch: petabytes
  EXPECT_TRUE(names(error_of("[model]\ndim = 131072\nn_layers = 16384\n"), "model.dim"));
  EXPECT_EQ(error_of("[train]\nactivation_checkpoint = \"every:2\"\n"), "");
}

// One bound on experts for the recipe and the MoE kernels (kernels::kMaxExperts), the figure
// docs/recipe.md's "Limits" gives.
TEST(RecipeLimits, ExpertCountsStopAtTheKernelsBound) {
  EXPECT_EQ(t3d::kernels::kMaxExperts, 1024);
  const std::string most = std::to_string(t3d::kernels::kMaxExperts);
  const std::string over = std::to_string(t3d::kernels::kMaxExperts + 1);
  EXPECT_EQ(error_of("[model]\nn_experts = " + most + "\n"), "");
  EXPECT_TRUE(names(error_of("[model]\nn_experts = " + over + "\n"), "model.n_experts"));
  EXPECT_TRUE(names(error_of("[model]\nn_experts = 4\nn_shared_experts = " + over + "\n"),
                    "model.n_shared_experts"));
}

// The 64-bit guard counts a mixture of experts' weights (n_experts·3·dim·moe_ffn_dim per MoE
// block): here 3·2^60 floats of experts, 3·2^62 bytes, beyond int64, while the dense part
// (8192·4·2^34 ≈ 2^49 floats) passes. And the routed rows among a micro-batch's activations:
// each token's experts_per_token rows, 2^21 tokens · 1024 blocks · 1024 rows · 4·1024 ≈ 2^53.
TEST(RecipeLimits, ExpertWeightsCountInTheOverflowGuard) {
  const std::string huge =
      "[model]\ndim = 131072\nn_heads = 8\nn_layers = 8192\nffn_dim = 64\nn_experts = 1024\n"
      "moe_ffn_dim = 1048576\n";
  const std::string e = error_of(huge);
  EXPECT_TRUE(names(e, "model.n_experts")) << e;
  EXPECT_NE(e.find("n_experts·3·dim·moe_ffn_dim"), std::string::npos) << e;
  EXPECT_EQ(error_of(huge, {parse_override("model.moe_ffn_dim=64")}), "");  // 3·2^46 floats
  EXPECT_EQ(error_of(huge, {parse_override("model.n_experts=0")}), "");     // the dense model
  const std::string rows =
      "[model]\nn_layers = 1024\nn_experts = 1024\nexperts_per_token = 1024\n"
      "moe_ffn_dim = 1024\n[train]\nglobal_batch = 16384\n";
  EXPECT_TRUE(names(error_of(rows), "train.global_batch")) << error_of(rows);
  EXPECT_EQ(error_of(rows, {parse_override("model.experts_per_token=2")}), "");
}

TEST(RecipeLimits, NonsenseValuesAreRefusedNamingTheKey) {
  const std::pair<std::string, std::string> cases[] = {
      {"parallel.bucket_mb=inf", "parallel.bucket_mb"},
      {"parallel.bucket_mb=nan", "parallel.bucket_mb"},
      {"parallel.timeout_s=1e-9", "parallel.timeout_s"},
      {"parallel.timeout_s=inf", "parallel.timeout_s"},
      {"hardware.openblas_coretype=bogus", "hardware.openblas_coretype"},
      {"hardware.hbm_gib=inf", "hardware.hbm_gib"},
      {"hardware.hbm_gib=1e300", "hardware.hbm_gib"},
      {"train.lr=1e999", "train.lr"},
      {"model.rope_theta=inf", "model.rope_theta"},
      {"train.grad_clip=inf", "train.grad_clip"},
      {"run.replay_every=-1", "run.replay_every"},
      {"run.on_corruption=bogus", "run.on_corruption"},
  };
  for (const auto& [set, key] : cases) EXPECT_TRUE(names(set_error(set), key)) << set_error(set);
  EXPECT_EQ(set_error("hardware.openblas_coretype=haswell"), "");  // OpenBLAS ignores case
  EXPECT_EQ(set_error("parallel.timeout_s=5"), "");
  EXPECT_EQ(set_error("run.replay_every=5"), "");
  EXPECT_EQ(set_error("run.on_corruption=stop"), "");
  EXPECT_EQ(set_error("run.on_corruption=exclude"), "");  // the launcher's (supervise/exclude.h)
}

TEST(RecipeLimits, SetValueWithLineBreaksIsRefused) {
  for (const char* set : {"run.name=a\nb", "train.steps=5\n[model]\ndim = 64", "run.name=a\rb"}) {
    const std::string e = set_error(set);
    EXPECT_NE(e.find("spans several lines"), std::string::npos) << e;
    EXPECT_NE(e.find("--set"), std::string::npos) << e;
  }
}

TEST(RecipeLimits, DirectoryIsNotARecipe) {
  const fs::path dir = fs::temp_directory_path() / "t3d_recipe_dir_test";
  fs::create_directories(dir);
  try {
    load_recipe(dir.string());
    FAIL() << "a directory was read as a recipe";
  } catch (const t3d::UserError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("is a directory"), std::string::npos) << e.what();
  }
  fs::remove(dir);
  EXPECT_THROW(load_recipe((dir / "missing.toml").string()), t3d::UserError);
}
