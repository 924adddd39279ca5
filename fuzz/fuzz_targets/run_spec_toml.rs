#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| arl_fuzz::run_spec_toml(data));
