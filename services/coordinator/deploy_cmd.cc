// `dflash deploy prometheus` (see deploy_cmd.h).
#include "services/coordinator/deploy_cmd.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "core/util/error.h"
#include "core/util/flags.h"

namespace dflash::cli {
namespace {

constexpr const char* kUsage =
    "usage: dflash deploy prometheus CONFIG [--out FILE] [--coordinator-host HOST]\n"
    "                                [--address NAME=ADDR[,NAME=ADDR...]] [--scrape-interval 15s]\n"
    "  Writes a Prometheus scrape config (YAML) with the coordinator's metrics port and every\n"
    "  worker's port (coordinator.worker_metrics_port_base + i), labelled role/rank/host/gpu.\n"
    "  --address maps a topology host name to the address Prometheus scrapes (e.g. the IP of the\n"
    "  Proxmox container the workers run in). Ports set to 0 are explained, not scraped.\n";

// A YAML double-quoted scalar.
std::string q(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    o += ch;
  }
  return o + "\"";
}

bool is_wildcard(const std::string& h) { return h.empty() || h == "0.0.0.0" || h == "::" || h == "[::]" || h == "*"; }

std::string listen_host(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
}

std::vector<std::pair<std::string, std::string>> parse_addresses(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    DFLASH_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < item.size(), ConfigError,
                 "--address: expected NAME=ADDR[,NAME=ADDR...], got '" << text << "'");
    out.emplace_back(item.substr(0, eq), item.substr(eq + 1));
  }
  return out;
}

}  // namespace

std::vector<ScrapeTarget> prometheus_targets(const config::RunConfig& c, const PrometheusOptions& o,
                                             std::vector<std::string>* notes) {
  std::map<std::string, std::string> addr;
  std::set<std::string> names;
  for (const auto& h : c.topology.hosts) names.insert(h.name);
  for (const auto& [name, a] : o.addresses) {
    DFLASH_CHECK(names.count(name), ConfigError,
                 "--address " << name << "=" << a << ": no topology.hosts entry is named '" << name << "'");
    addr[name] = a;
  }
  std::vector<ScrapeTarget> out;
  const auto& co = c.coordinator;
  if (co.metrics_port > 0) {
    std::string host = o.coordinator_host;
    if (host.empty()) host = listen_host(co.listen);
    if (is_wildcard(host)) host = "localhost";
    ScrapeTarget t;
    t.job = "dflash-coordinator";
    t.address = host + ":" + std::to_string(co.metrics_port);
    t.role = "coordinator";
    out.push_back(t);
  } else {
    notes->push_back("coordinator.metrics_port is 0 (off): the coordinator serves no /metrics, so it has no "
                     "scrape target; set a port to scrape it");
  }
  const int n_workers = c.num_targets() + c.num_drafters();
  if (co.worker_metrics_port_base <= 0) {
    notes->push_back("coordinator.worker_metrics_port_base is 0: workers serve /metrics on ephemeral ports (or "
                     "none), which a static scrape config cannot name, so the " + std::to_string(n_workers) +
                     " worker(s) have no scrape targets; set a base port (worker i serves base + i)");
    return out;
  }
  const int last = co.worker_metrics_port_base + n_workers - 1;
  DFLASH_CHECK(last <= 65535, ConfigError,
               "coordinator.worker_metrics_port_base " << co.worker_metrics_port_base << " + " << n_workers
                                                       << " workers runs past port 65535 (last " << last << ")");
  int worker = 0;
  for (const char* role : {"target", "drafter"}) {
    int rank = 0;
    for (const auto& h : c.topology.hosts) {
      const auto& gpus = std::string(role) == "target" ? h.target_gpus : h.drafter_gpus;
      for (int gpu : gpus) {
        ScrapeTarget t;
        t.job = std::string("dflash-") + role;
        const auto it = addr.find(h.name);
        t.address = (it == addr.end() ? h.name : it->second) + ":" + std::to_string(co.worker_metrics_port_base + worker);
        t.role = role;
        t.rank = rank++;
        t.worker = worker++;
        t.host = h.name;
        t.gpu = gpu;
        t.ctid = h.ctid;
        out.push_back(t);
      }
    }
  }
  if (co.metrics_port > 0 && co.metrics_port >= co.worker_metrics_port_base && co.metrics_port <= last) {
    notes->push_back("warning: coordinator.metrics_port " + std::to_string(co.metrics_port) +
                     " is inside the worker range [" + std::to_string(co.worker_metrics_port_base) + ", " +
                     std::to_string(last) + "]: it collides if the coordinator shares a host with those workers");
  }
  return out;
}

std::string prometheus_yaml(const config::RunConfig& c, const PrometheusOptions& o) {
  std::vector<std::string> notes;
  const auto targets = prometheus_targets(c, o, &notes);
  std::ostringstream y;
  y << "# Prometheus scrape config for dflash run '" << c.run.name << "', generated by\n"
    << "#   dflash deploy prometheus " << o.source << "\n"
    << "# " << targets.size() << " target(s): the coordinator (coordinator.metrics_port) and worker i at\n"
    << "# coordinator.worker_metrics_port_base + i (targets first, then drafters, in host order).\n"
    << "# Use it as prometheus.yml, or copy the scrape_configs entries into yours.\n";
  for (const auto& n : notes) y << "# NOTE: " << n << "\n";
  y << "global:\n  scrape_interval: " << o.scrape_interval << "\n";
  std::ostringstream jobs;
  for (const char* job : {"dflash-coordinator", "dflash-target", "dflash-drafter"}) {
    bool opened = false;
    for (const auto& t : targets) {
      if (t.job != job) continue;
      if (!opened) jobs << "  - job_name: " << q(job) << "\n    static_configs:\n";
      opened = true;
      jobs << "      - targets: [" << q(t.address) << "]\n        labels:\n"
           << "          run: " << q(c.run.name) << "\n"
           << "          role: " << q(t.role) << "\n"
           << "          rank: " << q(std::to_string(t.rank)) << "\n";
      if (t.worker >= 0) {
        jobs << "          worker: " << q(std::to_string(t.worker)) << "\n"
             << "          host: " << q(t.host) << "\n"
             << "          gpu: " << q(std::to_string(t.gpu)) << "\n";
        if (t.ctid > 0) jobs << "          ctid: " << q(std::to_string(t.ctid)) << "\n";
      }
    }
  }
  y << (targets.empty() ? "scrape_configs: []\n" : "scrape_configs:\n" + jobs.str());
  return y.str();
}

int cmd_deploy(int argc, char** argv) {
  if (argc < 1 || std::string(argv[0]) == "-h" || std::string(argv[0]) == "--help") {
    std::cerr << kUsage;
    return argc < 1 ? kExitConfig : kExitOk;
  }
  if (std::string(argv[0]) != "prometheus") {
    std::cerr << "dflash deploy: unknown subcommand '" << argv[0] << "'\n" << kUsage;
    return kExitConfig;
  }
  Flags f(argc - 1, argv + 1, {"out", "coordinator-host", "address", "scrape-interval", "help"}, {"help"});
  if (f.has("help")) {
    std::cout << kUsage;
    return kExitOk;
  }
  if (f.positional().size() != 1) {
    std::cerr << "dflash deploy prometheus: expected exactly one CONFIG, got " << f.positional().size() << "\n"
              << kUsage;
    return kExitConfig;
  }
  const std::string file = f.positional()[0];
  const config::ParseResult r = config::parse_config_file(file);
  if (!r.ok()) {
    for (const auto& p : r.problems) std::cerr << config::format_problem(file, p) << "\n";
    std::cerr << file << ": " << r.problems.size() << " problem(s)\n";
    return kExitConfig;
  }
  PrometheusOptions o;
  o.coordinator_host = f.get("coordinator-host", "");
  o.addresses = parse_addresses(f.get("address", ""));
  o.scrape_interval = f.get("scrape-interval", o.scrape_interval);
  o.source = file;
  std::vector<std::string> notes;
  const auto targets = prometheus_targets(r.config, o, &notes);
  for (const auto& n : notes) std::cerr << "dflash deploy prometheus: " << n << "\n";
  const std::string text = prometheus_yaml(r.config, o);
  if (!f.has("out")) {
    std::cout << text;
  } else {
    const std::string out = f.get("out"), tmp = out + ".tmp";
    {
      std::ofstream w(tmp, std::ios::trunc);
      DFLASH_CHECK(w.good(), ConfigError, "--out " << out << ": cannot open " << tmp << " for writing");
      w << text;
      w.flush();
      DFLASH_CHECK(w.good(), ConfigError, "--out " << out << ": cannot write " << tmp);
    }
    DFLASH_CHECK(std::rename(tmp.c_str(), out.c_str()) == 0, ConfigError, "--out " << out << ": cannot rename " << tmp);
  }
  std::cerr << "dflash deploy prometheus: " << targets.size() << " scrape target(s)"
            << (f.has("out") ? " written to " + f.get("out") : std::string()) << "\n";
  return kExitOk;
}

}  // namespace dflash::cli
