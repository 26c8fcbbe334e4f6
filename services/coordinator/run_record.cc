#include "services/coordinator/run_record.h"

#include <yaml-cpp/yaml.h>

#include <map>
#include <set>

namespace dflash::coordinator {
namespace {

using Flat = std::map<std::string, std::string>;

// Every leaf of `n` as "a.b.c" -> its YAML text (a list is one leaf, in flow style).
void flatten(const YAML::Node& n, const std::string& path, Flat& out) {
  if (n.IsMap()) {
    for (const auto& kv : n) flatten(kv.second, path.empty() ? kv.first.as<std::string>() : path + "." + kv.first.as<std::string>(), out);
    return;
  }
  YAML::Emitter e;
  e << YAML::Flow << n;
  out[path] = e.c_str();
}

Flat flat_yaml(const std::string& text) {
  Flat out;
  flatten(YAML::Load(text), "", out);
  return out;
}

bool may_change_on_resume(const std::string& path) {
  const std::string section = path.substr(0, path.find('.'));
  for (const char* s : {"topology", "coordinator", "resilience", "launch", "eval"})
    if (section == s) return true;
  for (const char* f : {"run.resume", "run.output_dir", "run.keep_last", "run.keep_every", "run.report_to"})
    if (path == f) return true;
  return false;
}

// The drift entries "FIELD: A -> B" of the map below, in key order.
std::vector<std::string> drift_lines(const std::map<std::string, std::pair<std::string, std::string>>& diff) {
  std::vector<std::string> out;
  for (const auto& [k, v] : diff)
    if (!may_change_on_resume(k)) out.push_back(k + ": " + v.first + " -> " + v.second);
  return out;
}

}  // namespace

std::vector<std::string> resume_drift(const std::string& recorded_yaml, const config::RunConfig& current) {
  const auto reparsed = config::parse_config_string(recorded_yaml, "the run record's config");
  const bool complete = reparsed.ok();  // else: an older release's record, compared on the keys both have
  const Flat was = complete ? flat_yaml(config::to_yaml(reparsed.config)) : flat_yaml(recorded_yaml);
  const Flat now = flat_yaml(config::to_yaml(current));
  std::map<std::string, std::pair<std::string, std::string>> diff;
  for (const auto& [k, v] : was) {
    auto it = now.find(k);
    if (it == now.end()) {
      if (complete) diff[k] = {v, "(unset)"};
    } else if (it->second != v) {
      diff[k] = {v, it->second};
    }
  }
  if (complete)
    for (const auto& [k, v] : now)
      if (!was.count(k)) diff[k] = {"(unset)", v};
  return drift_lines(diff);
}

ResumeChanges resume_changes(const std::string& recorded_yaml, const config::RunConfig& current,
                             const std::vector<std::string>& overrides) {
  YAML::Node recorded;
  try {
    recorded = YAML::Load(recorded_yaml);
  } catch (const YAML::Exception&) {  // resume_drift reports what it can of such a record
  }
  const bool has_kernels = recorded.IsMap() && recorded["kernels"].IsDefined();
  std::set<std::string> set_on_command_line;
  for (const auto& o : overrides) set_on_command_line.insert(o.substr(0, o.find('=')));
  ResumeChanges out;
  for (const std::string& line : resume_drift(recorded_yaml, current)) {
    const std::string field = line.substr(0, line.find(": "));
    if (field.rfind("kernels.", 0) != 0)
      out.refused.push_back(line);
    else if (!has_kernels)
      out.unrecorded.push_back(line);
    else if (set_on_command_line.count(field) || set_on_command_line.count("kernels"))
      out.overridden.push_back(line);
    else
      out.refused.push_back(line);
  }
  return out;
}

}  // namespace dflash::coordinator
