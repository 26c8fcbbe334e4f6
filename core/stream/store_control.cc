#include "core/stream/store_control.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <mutex>
#include <vector>

#include "core/util/error.h"
#include "core/util/net.h"

namespace dflash::stream {
namespace {

class StoreControl final : public LinkControl {
 public:
  StoreControl(c10::intrusive_ptr<c10d::Store> store, std::string who) : store_(std::move(store)), who_(std::move(who)) {}
  void set(const std::string& key, const std::string& value) override {
    guarded("set " + key, [&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  std::optional<std::string> get_if(const std::string& key) override {
    std::optional<std::string> out;
    guarded("get " + key, [&] {
      if (!store_->check({key})) return;
      const auto v = store_->get(key);
      out = std::string(v.begin(), v.end());
    });
    return out;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t n = 0;
    guarded("add " + key, [&] { n = store_->add(key, delta); });
    return n;
  }

 private:
  template <class F>
  void guarded(const std::string& what, F f) {
    std::lock_guard<std::mutex> lk(mu_);
    try {
      f();
    } catch (const c10::Error& e) {
      DFLASH_FAIL(TransportError, who_ << ": store " << what << " failed (peer gone?): " << e.what_without_backtrace());
    } catch (const TransportError&) {
      throw;
    } catch (const std::exception& e) {
      DFLASH_FAIL(TransportError, who_ << ": store " << what << " failed (peer gone?): " << e.what());
    }
  }
  c10::intrusive_ptr<c10d::Store> store_;
  std::string who_;
  std::mutex mu_;
};

}  // namespace

c10::intrusive_ptr<c10d::Store> make_link_store(const std::string& who, const std::string& host, int port, bool server,
                                                std::chrono::milliseconds timeout) {
  DFLASH_CHECK(port > 0 && port < 65536, ConfigError, who << ": port " << port << " outside [1, 65535]");
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = server;
  so.numWorkers = std::nullopt;
  so.waitWorkers = false;
  so.timeout = timeout;
  // The receiver binds the socket itself, on `host` only (the store's own bind is a wildcard).
  if (server) so.masterListenFd = listen_tcp(host, port, who + ": the link store");
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, so);
  } catch (const c10::Error& e) {
    if (server)
      DFLASH_FAIL(TransportError, who << ": cannot host the link store on port " << port << ": " << e.what_without_backtrace());
    DFLASH_FAIL(TransportError, who << ": receiver's store at " << host << ":" << port << " unreachable within " << timeout.count()
                                    << " ms (is the receiver running?): " << e.what_without_backtrace());
  }
}

std::shared_ptr<LinkControl> make_store_control(c10::intrusive_ptr<c10d::Store> store, const std::string& who) {
  return std::make_shared<StoreControl>(std::move(store), who);
}

}  // namespace dflash::stream
