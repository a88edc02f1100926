fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/cxlkv.proto");
    println!("cargo:rerun-if-changed=proto/peer.proto");
    // The client API and the peer service between sidecars (which reuses the
    // client API's messages).
    let fds = protox::compile(["proto/cxlkv.proto", "proto/peer.proto"], ["proto"])?;
    // The server's codec answers undecodable requests with INVALID_ARGUMENT.
    tonic_prost_build::configure()
        .type_attribute(".", "#[allow(clippy::all)]")
        // `cxlkv status --json` prints the cluster's nodes as they come.
        .type_attribute(".cxlkv.v1.ClusterNode", "#[derive(serde::Serialize)]")
        .bytes(".")
        .codec_path("crate::codec::ValidatingCodec")
        .compile_fds(fds)?;
    // The slice of etcd's API the `etcd` election uses (clients only).
    println!("cargo:rerun-if-changed=proto/etcd");
    let fds = protox::compile(["proto/etcd/rpc.proto", "proto/etcd/v3election.proto"], ["proto"])?;
    tonic_prost_build::configure().type_attribute(".", "#[allow(clippy::all)]").build_server(false).compile_fds(fds)?;
    Ok(())
}
