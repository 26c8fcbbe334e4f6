#include "core/util/options.h"

#include <set>
#include <sstream>
#include <stdexcept>

#include "core/util/error.h"

namespace dflash {

Option flag(const std::string& name, const std::string& help) { return Option{name, "", "", "", help}; }
Option value(const std::string& name, const std::string& value_name, const std::string& default_value,
             const std::string& help) {
  return Option{name, value_name, default_value, "", help};
}
Option computed(const std::string& name, const std::string& value_name, const std::string& note,
                const std::string& help) {
  return Option{name, value_name, "", note, help};
}
Option required(const std::string& name, const std::string& value_name, const std::string& help) {
  return Option{name, value_name, "", "", help, false, true};
}
Option repeated(const std::string& name, const std::string& value_name, const std::string& help) {
  return Option{name, value_name, "", "", help, true};
}

namespace {

std::string flag_with_value(const Option& o) { return "--" + o.name + (o.value_name.empty() ? "" : " " + o.value_name); }

std::string positional_word(const Positional& p) {
  std::string w = p.repeated ? p.name + " ..." : p.name;
  return p.optional || p.repeated ? "[" + w + "]" : w;
}

// `words` joined by spaces into lines of at most `width` columns, every line after the first indented by `indent`.
std::string wrap(const std::vector<std::string>& words, size_t first_used, size_t width, size_t indent) {
  std::string out;
  size_t used = first_used;
  for (const auto& w : words) {
    if (used > first_used && used + 1 + w.size() > width) {
      out += "\n" + std::string(indent, ' ');
      used = indent;
    } else if (used > first_used || !out.empty()) {
      out += " ";
      ++used;
    }
    out += w;
    used += w.size();
  }
  return out;
}

std::vector<std::string> synopsis_words(const CommandSpec& spec) {
  std::vector<std::string> words;
  for (const auto& p : spec.positionals) words.push_back(positional_word(p));
  for (const auto& o : spec.options)
    if (o.required) words.push_back(flag_with_value(o));
  for (const auto& o : spec.options)
    if (!o.required) words.push_back("[" + flag_with_value(o) + "]" + (o.repeatable ? "..." : ""));
  return words;
}

std::string default_of(const Option& o) {
  if (o.required) return "required";
  if (!o.default_value.empty()) return o.default_value;
  return o.default_note;
}

// "  NAME    HELP" lines with the help column aligned, wrapped at 100 columns.
std::string aligned(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t col = 0;
  for (const auto& r : rows) col = std::max(col, r.first.size());
  col = std::min<size_t>(col + 4, 32);
  std::string out;
  for (const auto& [left, right] : rows) {
    std::string line = "  " + left;
    std::istringstream in(right);
    std::vector<std::string> words;
    for (std::string w; in >> w;) words.push_back(w);
    if (line.size() + 1 > col) {
      out += line + "\n";
      line = std::string(col, ' ');
    } else {
      line += std::string(col - line.size(), ' ');
    }
    out += line + wrap(words, col, 100, col) + "\n";
  }
  return out;
}

std::string indented(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  std::string out;
  for (std::string line; std::getline(in, line);) out += (line.empty() ? "" : prefix + line) + "\n";
  return out;
}

}  // namespace

std::string markdown_cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|')
      out += "\\|";
    else
      out += c == '\n' ? ' ' : c;
  }
  return out;
}

namespace {

std::string help_body(const CommandSpec& spec, const std::string& head) {
  std::string out = usage_lines(spec, head);
  if (!spec.positionals.empty()) {
    std::vector<std::pair<std::string, std::string>> rows;
    for (const auto& p : spec.positionals) rows.emplace_back(positional_word(p), p.help);
    out += "arguments:\n" + aligned(rows);
  }
  if (!spec.options.empty()) {
    std::vector<std::pair<std::string, std::string>> rows;
    for (const auto& o : spec.options) {
      const std::string d = default_of(o);
      rows.emplace_back(flag_with_value(o), o.help + (o.repeatable ? " (repeatable)" : "") +
                                                (d.empty() || d == "required" ? "" : " (default: " + d + ")") +
                                                (o.required ? " (required)" : ""));
    }
    out += "options:\n" + aligned(rows);
  }
  if (!spec.details.empty()) out += indented(spec.details, "  ");
  return out;
}

}  // namespace

std::string synopsis(const CommandSpec& spec) {
  std::string out;
  for (const auto& w : synopsis_words(spec)) out += (out.empty() ? "" : " ") + w;
  return out;
}

std::string usage_lines(const CommandSpec& spec, const std::string& head_word) {
  const std::string head = head_word + spec.name + " ";
  std::string out = head + wrap(synopsis_words(spec), head.size(), 100, head.size()) + "\n";
  if (!spec.summary.empty()) out += indented(spec.summary, "    ");
  return out;
}

std::string help_text(const CommandSpec& spec) {
  std::string out = help_body(spec, "usage: ");
  for (const auto& m : spec.modes) out += "\n" + help_body(m, "   or: ");
  return out;
}

std::string markdown_reference(const CommandSpec& spec) {
  std::string title = spec.name;  // a mode's: with the flag that selects it (a required boolean)
  for (const auto& o : spec.options)
    if (o.required && o.value_name.empty()) title += " --" + o.name;
  std::string out = "### `" + title + "`\n\n`" + spec.name + " " + synopsis(spec) + "`\n\n" + spec.summary + "\n";
  if (!spec.positionals.empty() || !spec.options.empty()) {
    out += "\n| argument | default | meaning |\n|---|---|---|\n";
    for (const auto& p : spec.positionals)
      out += "| `" + markdown_cell(positional_word(p)) + "` | " + (p.optional || p.repeated ? "" : "required") + " | " +
             markdown_cell(p.help) + " |\n";
    for (const auto& o : spec.options)
      out += "| `" + markdown_cell(flag_with_value(o)) + "` | " + markdown_cell(default_of(o)) + " | " + markdown_cell(o.help) +
             (o.repeatable ? " (repeatable)" : "") + " |\n";
  }
  if (!spec.details.empty()) out += "\n" + spec.details + (spec.details.back() == '\n' ? "" : "\n");
  for (const auto& m : spec.modes) out += "\n" + markdown_reference(m);
  return out;
}

std::vector<Option> all_options(const CommandSpec& spec) {
  std::vector<Option> out;
  std::set<std::string> seen;
  auto add = [&](const CommandSpec& s) {
    for (const auto& o : s.options)
      if (seen.insert(o.name).second) out.push_back(o);
  };
  add(spec);
  for (const auto& m : spec.modes) add(m);
  return out;
}

namespace {
std::set<std::string> names_of(const CommandSpec& spec, bool booleans_only) {
  std::set<std::string> out;
  for (const auto& o : spec.options)
    if (!booleans_only || o.value_name.empty()) out.insert(o.name);
  return out;
}
}  // namespace

Options::Options(int argc, char** argv, const CommandSpec& spec)
    : spec_(spec), flags_(argc, argv, names_of(spec, false), names_of(spec, true)) {}

const Option& Options::option(const std::string& name) const {
  for (const auto& o : spec_.options)
    if (o.name == name) return o;
  throw std::logic_error(spec_.name + ": --" + name + " is not in the command's option table");
}

const Option& Options::option_without_default(const std::string& name) const {
  const Option& o = option(name);
  if (!o.default_value.empty())
    throw std::logic_error(spec_.name + ": --" + name + " has the table default '" + o.default_value +
                           "'; read it with get/get_int/get_double");
  return o;
}

bool Options::has(const std::string& name) const {
  option(name);
  return flags_.has(name);
}

bool Options::enabled(const std::string& name) const {
  if (!has(name)) return false;
  const std::string v = flags_.get(name);
  return v != "0" && v != "false";
}

std::string Options::get(const std::string& name) const {
  const Option& o = option(name);
  if (flags_.has(name) || o.default_value.empty()) return flags_.get(name);  // absent: "missing required flag"
  return o.default_value;
}

namespace {
// A copy of `f`'s value conversion for the table's default: the same checks, the same message.
Flags default_as_flag(const std::string& name, const std::string& value) {
  std::string arg = "--" + name + "=" + value;
  char* argv[] = {arg.data()};
  return Flags(1, argv, {name});
}
}  // namespace

int64_t Options::get_int(const std::string& name) const {
  const Option& o = option(name);
  if (flags_.has(name)) return flags_.get_int(name, 0);
  DFLASH_CHECK(!o.default_value.empty(), ConfigError, "missing required flag --" << name);
  return default_as_flag(name, o.default_value).get_int(name, 0);
}

double Options::get_double(const std::string& name) const {
  const Option& o = option(name);
  if (flags_.has(name)) return flags_.get_double(name, 0);
  DFLASH_CHECK(!o.default_value.empty(), ConfigError, "missing required flag --" << name);
  return default_as_flag(name, o.default_value).get_double(name, 0);
}

std::vector<int64_t> Options::get_int_list(const std::string& name) const { return parse_int_list(get(name), "--" + name); }

std::string Options::get_or(const std::string& name, const std::string& computed) const {
  option_without_default(name);
  return flags_.get(name, computed);
}

int64_t Options::get_int_or(const std::string& name, int64_t computed) const {
  option_without_default(name);
  return flags_.get_int(name, computed);
}

double Options::get_double_or(const std::string& name, double computed) const {
  option_without_default(name);
  return flags_.get_double(name, computed);
}

const std::vector<std::string>& Options::get_all(const std::string& name) const {
  option(name);
  return flags_.get_all(name);
}

}  // namespace dflash
