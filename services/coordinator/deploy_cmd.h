// `dflash deploy prometheus CONFIG [--out FILE] [--coordinator-host H] [--address NAME=ADDR,...]
//  [--scrape-interval 15s]`: a Prometheus scrape config (YAML) generated from a run config.
//
// Targets (one per process that serves /metrics):
//   - the coordinator at COORD:coordinator.metrics_port, labels role=coordinator rank=0;
//     COORD is --coordinator-host, else coordinator.listen's host, else "localhost" when listen is
//     a wildcard (0.0.0.0, ::, *) or empty;
//   - worker i at ADDR(host):coordinator.worker_metrics_port_base + i, labels role, rank, host,
//     gpu (and ctid when the host has one). Workers are numbered as the coordinator numbers them:
//     targets 0..N-1 in host order (then target_gpus order), drafters N..N+M-1 in host order;
//     rank is the rank within the role (target r is worker r, drafter d is worker N + d).
//     ADDR(host) is the address given by --address NAME=ADDR, else topology.hosts[].name. With
//     `pct` launch the workers run inside the container, so pass the container's address there.
// Every target also carries the labels run (run.name) and job (dflash-coordinator,
// dflash-target, dflash-drafter).
//
// Ports 0 are handled explicitly: coordinator.metrics_port 0 (off) gives no coordinator target and
// worker_metrics_port_base 0 (workers bind ephemeral ports, or none) gives no worker targets; each
// such case is explained in a YAML comment and on stderr. A worker port past 65535 is a
// ConfigError (exit 2), as is an invalid config or an --address naming no host.
// The YAML is a complete prometheus.yml (global + scrape_configs); its scrape_configs entries can
// be pasted into an existing one. Written to --out atomically (tmp + rename) or to stdout.
// No LibTorch: needs only dflash_config.
#pragma once
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/util/options.h"

namespace dflash::cli {

struct PrometheusOptions {
  std::string coordinator_host;                        // "" = from coordinator.listen
  std::vector<std::pair<std::string, std::string>> addresses;  // host name -> scrape address
  std::string scrape_interval = "15s";
  std::string source = "CONFIG";                       // shown in the header comment
};

struct ScrapeTarget {
  std::string job;   // dflash-coordinator | dflash-target | dflash-drafter
  std::string address;  // HOST:PORT
  std::string role;  // coordinator | target | drafter
  int rank = 0;      // within the role
  int worker = -1;   // worker index (-1 for the coordinator)
  std::string host;  // topology host name ("" for the coordinator)
  int gpu = -1;
  int ctid = 0;
};

// The targets, in worker order (coordinator first); `notes` receives one line per port that is
// 0 and therefore not scraped. Throws ConfigError as described above.
std::vector<ScrapeTarget> prometheus_targets(const config::RunConfig& c, const PrometheusOptions& o,
                                             std::vector<std::string>* notes);
// The YAML text (header comment, notes as comments, global, scrape_configs).
std::string prometheus_yaml(const config::RunConfig& c, const PrometheusOptions& o);

// `dflash deploy prometheus CONFIG [...]`: argv holds the arguments after "prometheus". Returns an
// exit code.
int cmd_deploy_prometheus(int argc, char** argv);
// Its option table (core/util/options.h).
const CommandSpec& deploy_prometheus_spec();

}  // namespace dflash::cli
