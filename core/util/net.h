// Listening sockets of a run: the address resolution and bind every server of this repository
// that owns its socket shares (/metrics, the drafters' TCPStore), so none binds a wildcard address
// unless the config names one (config::bind_host decides the address).
#pragma once
#include <netinet/in.h>

#include <string>

namespace dflash {

// The IPv4 address of `host`: a dotted quad, or a name resolved with getaddrinfo (AF_INET).
// ConfigError naming `what` and `host` when it is neither.
in_addr ipv4_address(const std::string& host, const std::string& what);

// A TCP socket (close-on-exec, SO_REUSEADDR, never SO_REUSEPORT) bound to host:port and listening
// (port 0: an ephemeral one). The caller owns the descriptor. ConfigError as ipv4_address; when
// the bind fails, TransportError naming `what`, the address and the port's holder
// (tcp_port_holder, core/util/process.h).
int listen_tcp(const std::string& host, int port, const std::string& what);

}  // namespace dflash
