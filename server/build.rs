//! Generates the gRPC types and service from `contract/tollgate.proto`, the operator's
//! `proto/tollgate/admin.proto`, and Envoy's RLS v3 (the subset in `proto/envoy/`, server side
//! only).
//!
//! The protos are parsed by `protox` (pure Rust), so building the service needs no `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = "../contract";
    let proto = "../contract/tollgate.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], [proto_dir])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Malformed protobuf must be INVALID_ARGUMENT, not the INTERNAL that prost's codec gives.
        .codec_path("crate::api::grpc::StrictCodec")
        .compile_fds(fds)?;

    // The operator's service (ops/buckets.rs), behind the admin token.
    let admin = "proto/tollgate/admin.proto";
    let fds = protox::compile([admin], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::api::grpc::StrictCodec")
        .compile_fds(fds)?;

    let rls = "proto/envoy/service/ratelimit/v3/rls.proto";
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile([rls], ["proto"])?;
    // tonic-prost's own codec, not Take's StrictCodec: a malformed RLS request stays INTERNAL.
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
