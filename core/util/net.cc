#include "core/util/net.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/util/error.h"
#include "core/util/process.h"

namespace dflash {

in_addr ipv4_address(const std::string& host, const std::string& what) {
  in_addr a{};
  if (::inet_pton(AF_INET, host.c_str(), &a) == 1) return a;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  DFLASH_CHECK(rc == 0 && res, ConfigError,
               what << ": bind address '" << host << "' is neither an IPv4 address nor a resolvable host name: "
                    << ::gai_strerror(rc));
  a = reinterpret_cast<const sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return a;
}

int listen_tcp(const std::string& host, int port, const std::string& what) {
  DFLASH_CHECK(port >= 0 && port < 65536, ConfigError, what << ": port " << port << " is not a port");
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr = ipv4_address(host, what);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  DFLASH_CHECK(fd >= 0, TransportError, what << ": socket(): " << std::strerror(errno));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(fd, 64) != 0) {
    const int err = errno;
    ::close(fd);
    DFLASH_FAIL(TransportError, what << ": cannot listen on " << host << ":" << port << ": " << std::strerror(err)
                                     << (err == EADDRINUSE ? " (holder: " + tcp_port_holder(port) + ")" : ""));
  }
  return fd;
}

}  // namespace dflash
