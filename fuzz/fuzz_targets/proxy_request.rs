#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| arl_fuzz::proxy_request(data));
