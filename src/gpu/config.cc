// Node declarations from JSON (nlohmann-json, Debian's nlohmann-json3-dev).
// nlohmann reports errors with exceptions; they stay inside this file.
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "deepnex/gpu/discovery.h"
#include "deepnex/units.h"

namespace deepnex::gpu {
namespace {

using nlohmann::json;

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  absl::Status Bad(const std::string& path, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", path, ": ", what));
  }

  absl::Status Keys(const json& obj, const std::string& path,
                    const std::set<std::string>& allowed) const {
    if (!obj.is_object()) return Bad(path, absl::StrCat("expected an object, got ", obj.dump()));
    for (const auto& [key, value] : obj.items()) {
      if (!allowed.count(key)) {
        std::string list;
        for (const auto& a : allowed) absl::StrAppend(&list, list.empty() ? "" : ", ", a);
        return Bad(path, absl::StrCat("unknown key \"", key, "\" (known: ", list, ")"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status String(const json& v, const std::string& path, std::string* out) const {
    if (!v.is_string()) return Bad(path, absl::StrCat("expected a string, got ", v.dump()));
    *out = v.get<std::string>();
    return absl::OkStatus();
  }

  absl::Status Int(const json& v, const std::string& path, int64_t lo, int64_t hi,
                   int* out) const {
    if (!v.is_number_integer()) {
      return Bad(path, absl::StrCat("expected an integer, got ", v.dump()));
    }
    int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) {
      return Bad(path, absl::StrCat(x, " is out of range [", lo, ", ", hi, "]"));
    }
    *out = static_cast<int>(x);
    return absl::OkStatus();
  }

  absl::Status Bytes(const json& v, const std::string& path, uint64_t* out) const {
    if (v.is_number_unsigned()) {
      *out = v.get<uint64_t>();
    } else if (v.is_string()) {
      auto parsed = ParseByteSize(v.get<std::string>(), path);
      if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat(source_, ": ", parsed.status().message()));
      *out = *parsed;
    } else {
      return Bad(path, absl::StrCat("expected a byte size (\"80GiB\" or bytes), got ", v.dump()));
    }
    if (*out == 0) return Bad(path, "must be positive, got 0");
    return absl::OkStatus();
  }

  absl::Status ParseGpu(const json& v, const std::string& path, Gpu* g) const {
    DEEPNEX_RETURN_IF_ERROR(Keys(v, path, {"memory", "uuid", "name", "index", "numa_node",
                                           "switch_id", "pci_bus_id"}));
    if (!v.contains("memory")) return Bad(path, "missing \"memory\"");
    DEEPNEX_RETURN_IF_ERROR(Bytes(v["memory"], path + ".memory", &g->memory));
    if (v.contains("uuid")) DEEPNEX_RETURN_IF_ERROR(String(v["uuid"], path + ".uuid", &g->uuid));
    if (v.contains("name")) DEEPNEX_RETURN_IF_ERROR(String(v["name"], path + ".name", &g->name));
    if (v.contains("pci_bus_id")) {
      DEEPNEX_RETURN_IF_ERROR(String(v["pci_bus_id"], path + ".pci_bus_id", &g->pci_bus_id));
    }
    if (v.contains("index")) DEEPNEX_RETURN_IF_ERROR(Int(v["index"], path + ".index", 0, 1 << 16, &g->index));
    if (v.contains("numa_node")) {
      DEEPNEX_RETURN_IF_ERROR(Int(v["numa_node"], path + ".numa_node", -1, 1 << 16, &g->numa_node));
    }
    if (v.contains("switch_id")) {
      DEEPNEX_RETURN_IF_ERROR(Int(v["switch_id"], path + ".switch_id", -1, 1 << 16, &g->switch_id));
    }
    return absl::OkStatus();
  }

  absl::Status ParseNode(const json& v, const std::string& path, Node* n) const {
    DEEPNEX_RETURN_IF_ERROR(Keys(v, path, {"name", "cpus", "memory", "mode", "labels", "gpus"}));
    for (const char* key : {"name", "cpus", "memory"}) {
      if (!v.contains(key)) return Bad(path, absl::StrCat("missing \"", key, "\""));
    }
    DEEPNEX_RETURN_IF_ERROR(String(v["name"], path + ".name", &n->name));
    DEEPNEX_RETURN_IF_ERROR(Int(v["cpus"], path + ".cpus", 1, 1 << 20, &n->cpus));
    DEEPNEX_RETURN_IF_ERROR(Bytes(v["memory"], path + ".memory", &n->memory));
    if (v.contains("mode")) {
      std::string mode;
      DEEPNEX_RETURN_IF_ERROR(String(v["mode"], path + ".mode", &mode));
      auto m = ParseMode(mode, path + ".mode");
      if (!m.ok()) return absl::InvalidArgumentError(absl::StrCat(source_, ": ", m.status().message()));
      n->mode = *m;
    }
    if (v.contains("labels")) {
      const json& labels = v["labels"];
      if (!labels.is_object()) {
        return Bad(path + ".labels", absl::StrCat("expected an object, got ", labels.dump()));
      }
      for (const auto& [key, value] : labels.items()) {
        DEEPNEX_RETURN_IF_ERROR(String(value, path + ".labels." + key, &n->labels[key]));
      }
    }
    if (v.contains("gpus")) {
      const json& gpus = v["gpus"];
      const std::string gp = path + ".gpus";
      if (gpus.is_array()) {
        for (size_t i = 0; i < gpus.size(); ++i) {
          Gpu g;
          DEEPNEX_RETURN_IF_ERROR(ParseGpu(gpus[i], absl::StrCat(gp, "[", i, "]"), &g));
          n->gpus.push_back(std::move(g));
        }
      } else if (gpus.is_object()) {
        DEEPNEX_RETURN_IF_ERROR(Keys(gpus, gp, {"count", "memory"}));
        if (!gpus.contains("count") || !gpus.contains("memory")) {
          return Bad(gp, "needs \"count\" and \"memory\"");
        }
        int count;
        uint64_t memory;
        DEEPNEX_RETURN_IF_ERROR(Int(gpus["count"], gp + ".count", 0, 4096, &count));
        DEEPNEX_RETURN_IF_ERROR(Bytes(gpus["memory"], gp + ".memory", &memory));
        for (int i = 0; i < count; ++i) {
          Gpu g;
          g.memory = memory;
          n->gpus.push_back(g);
        }
      } else {
        return Bad(gp, absl::StrCat("expected a list of GPUs or {\"count\", \"memory\"}, got ",
                                    gpus.dump()));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::string source_;
};

}  // namespace

absl::StatusOr<std::vector<Node>> ParseNodesJson(const std::string& text,
                                                 const std::string& source) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    size_t line = 1, column = 1;
    for (size_t i = 0; i + 1 < e.byte && i < text.size(); ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    std::string what = e.what();
    size_t colon = what.find(": ", what.find("parse error"));
    std::string detail = colon == std::string::npos ? what : what.substr(colon + 2);
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": line ", line, ", column ", column, ": ", detail));
  }
  Reader reader(source);
  std::vector<Node> nodes;
  DEEPNEX_RETURN_IF_ERROR(reader.Keys(doc, "top level", {"nodes"}));
  if (!doc.contains("nodes") || !doc["nodes"].is_array()) {
    return reader.Bad("nodes", "expected a list of nodes");
  }
  std::set<std::string> names;
  const json& list = doc["nodes"];
  for (size_t i = 0; i < list.size(); ++i) {
    Node n;
    const std::string path = absl::StrCat("nodes[", i, "]");
    DEEPNEX_RETURN_IF_ERROR(reader.ParseNode(list[i], path, &n));
    if (!names.insert(n.name).second) {
      return reader.Bad(path + ".name", absl::StrCat("duplicate node name \"", n.name, "\""));
    }
    nodes.push_back(std::move(n));
  }
  return nodes;
}

absl::StatusOr<std::vector<Node>> LoadNodesFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("nodes file \"", path, "\" cannot be read"));
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseNodesJson(ss.str(), path);
}

}  // namespace deepnex::gpu
