fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/cxlkv.proto");
    let fds = protox::compile(["proto/cxlkv.proto"], ["proto"])?;
    tonic_prost_build::configure().type_attribute(".", "#[allow(clippy::all)]").bytes(".").compile_fds(fds)?;
    Ok(())
}
