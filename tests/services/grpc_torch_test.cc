// A real gRPC round trip in a binary that also links LibTorch: proves the link order
// (protobuf/gRPC before the torch wheel, which exports its own protobuf symbols) is right.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "control.grpc.pb.h"

namespace {
using dflash::control::Coordinator;

class EchoCoordinator final : public Coordinator::Service {
 public:
  grpc::Status Register(grpc::ServerContext* ctx, const dflash::control::RegisterRequest* req,
                        dflash::control::RegisterResponse* resp) override {
    auto it = ctx->client_metadata().find("x-dflash-token");
    if (it == ctx->client_metadata().end() || it->second != "secret")
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or wrong x-dflash-token");
    // Use LibTorch inside the handler too.
    auto t = torch::arange(req->rank() + 1, torch::kFloat32).sum();
    resp->set_worker_id(static_cast<int64_t>(t.item<float>()));
    resp->set_run_id("run-" + std::to_string(req->pid()));
    return grpc::Status::OK;
  }
};

TEST(GrpcWithTorch, RegisterRoundTrip) {
  EchoCoordinator service;
  int port = 0;
  grpc::ServerBuilder b;
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  auto server = b.BuildAndStart();
  ASSERT_TRUE(server);
  ASSERT_GT(port, 0);
  auto stub = Coordinator::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                       grpc::InsecureChannelCredentials()));
  dflash::control::RegisterRequest req;
  req.set_rank(4);
  req.set_pid(77);
  dflash::control::RegisterResponse resp;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-dflash-token", "secret");
    auto st = stub->Register(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(resp.worker_id(), 10);  // 0+1+2+3+4
    EXPECT_EQ(resp.run_id(), "run-77");
  }
  {
    grpc::ClientContext ctx;  // no token: refused
    auto st = stub->Register(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  server->Shutdown();
}
}  // namespace
