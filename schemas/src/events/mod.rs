//! Every event of the pipeline. `v1/` holds the first published version of each; a
//! published struct is never edited — a change goes into a new version beside it.

pub mod common;
pub mod v1;
pub mod v2;

pub use common::*;
pub use v1::*;
pub use v2::*;

/// A complete, realistic instance of an event: the golden files and test fixtures start
/// from these.
pub trait Example {
    fn example() -> Self;
}

/// Implements [`crate::Event`] for a struct with a `run_id` field.
macro_rules! event {
    ($ty:ty, $domain:ident, $event:literal, $version:literal, |$s:ident| $id:expr) => {
        impl crate::Event for $ty {
            const TYPE: &'static str = concat!(stringify!($domain), ".", $event);
            const VERSION: u32 = $version;
            const DOMAIN: crate::Domain = crate::event_domain!($domain);

            fn subject(&self, ns: &crate::Namespace) -> String {
                ns.event_subject(Self::DOMAIN, &self.run_id, $event)
            }

            fn filter(ns: &crate::Namespace) -> String {
                ns.event_filter(Self::DOMAIN, $event)
            }

            fn message_id(&self) -> String {
                let $s = self;
                $id
            }
        }
    };
}
pub(crate) use event;

#[doc(hidden)]
#[macro_export]
macro_rules! event_domain {
    (run) => {
        $crate::Domain::Run
    };
    (task) => {
        $crate::Domain::Task
    };
    (image) => {
        $crate::Domain::Image
    };
    (sandbox) => {
        $crate::Domain::Sandbox
    };
    (trial) => {
        $crate::Domain::Trial
    };
    (llm) => {
        $crate::Domain::Llm
    };
    (trajectory) => {
        $crate::Domain::Trajectory
    };
    (reward) => {
        $crate::Domain::Reward
    };
    (train) => {
        $crate::Domain::Train
    };
    (weights) => {
        $crate::Domain::Weights
    };
    (eval) => {
        $crate::Domain::Eval
    };
}
