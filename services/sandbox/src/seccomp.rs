//! The seccomp filter every sandboxed command runs under (bubblewrap `--seccomp`): the
//! network a sandbox may use is TCP to its own loopback (the token proxy's relay), so
//! IPv6, UDP, raw and packet sockets are refused; and kernel interfaces no task needs and
//! that have been doors out of containers (keyrings, eBPF, perf events, userfaultfd,
//! io_uring, modules, kexec, file handles) return EPERM.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// Syscalls refused whatever their arguments.
const REFUSED: &[i64] = &[
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_open_by_handle_at,
];

fn condition(arg: u8, op: SeccompCmpOp, value: i32) -> Result<SeccompCondition, String> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value as u64).map_err(|e| e.to_string())
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, String> {
    SeccompRule::new(conditions).map_err(|e| e.to_string())
}

/// The filter as bubblewrap reads it: the BPF program's instructions, in native order.
pub fn filter_bytes() -> Result<Vec<u8>, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for syscall in REFUSED {
        rules.insert(*syscall, Vec::new());
    }
    // socket(domain, type, protocol): the type's low bits are the kind (flags above).
    let kind = SeccompCmpOp::MaskedEq(0xf);
    let mut socket = Vec::new();
    for domain in [libc::AF_INET6, libc::AF_PACKET] {
        socket.push(rule(vec![condition(0, SeccompCmpOp::Eq, domain)?])?);
    }
    for refused in [libc::SOCK_DGRAM, libc::SOCK_RAW, libc::SOCK_SEQPACKET] {
        socket.push(rule(vec![
            condition(0, SeccompCmpOp::Eq, libc::AF_INET)?,
            condition(1, kind.clone(), refused)?,
        ])?);
    }
    rules.insert(libc::SYS_socket, socket);
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("no seccomp filter for {}: {e:?}", std::env::consts::ARCH))?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| e.to_string())?;
    let program: BpfProgram = filter.try_into().map_err(|e| format!("{e:?}"))?;
    let mut bytes = Vec::with_capacity(program.len() * 8);
    for instruction in program {
        bytes.extend(instruction.code.to_ne_bytes());
        bytes.push(instruction.jt);
        bytes.push(instruction.jf);
        bytes.extend(instruction.k.to_ne_bytes());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_filter_compiles_for_this_machine() {
        let bytes = super::filter_bytes().unwrap();
        assert!(!bytes.is_empty() && bytes.len().is_multiple_of(8));
    }
}
