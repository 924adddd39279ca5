//! Reward: grading a trial's result.
//!
//! - [`logparse`]: test logs → test statuses, with the SWE-bench harness's parsers;
//! - [`grading`]: statuses against FAIL_TO_PASS / PASS_TO_PASS → resolved or not;
//! - [`swebench`]: how a patch is evaluated in a clean sandbox of its environment;
//! - [`harbor`]: a Harbor task's hidden `tests/test.sh` run the same way, its reward read;
//! - [`grader`]: one candidate for one task graded in a fresh sandbox (what the service and
//!   `arl dataset validate` share);
//! - [`service`]: the NATS service that grades every finished trial.

pub mod grader;
pub mod grading;
pub mod harbor;
pub mod hosted;
pub mod logparse;
pub mod service;
pub mod swebench;
