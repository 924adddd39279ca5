//! The CUDA backend's kernels compile on a machine without a GPU: NVRTC from PyPI (the tools
//! venv's nvidia-cuda-nvrtc) compiles `kernels.cu` as the backend does when it opens a GPU,
//! then to an sm_90 cubin, through `scripts/nvrtc-check.py`. Without this, a kernel that
//! does not compile would only show in a device run, where it stops every GPU test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

#[test]
fn the_cuda_kernels_compile_for_hopper() {
    let python = std::env::var_os("ARL_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                .join(".cache/arl/tools/bin/python")
        });
    assert!(
        python.exists(),
        "{} is missing: run `make deps` (the tools venv has NVRTC)",
        python.display()
    );
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = std::process::Command::new(&python)
        .arg(manifest.join("../../scripts/nvrtc-check.py"))
        .arg(manifest.join("src/cuda/kernels.cu"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    eprintln!("{stdout}");
    assert!(
        output.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("kernels compile for sm_90"), "{stdout}");
}
