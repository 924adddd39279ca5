//! The split and the batches. Each task's place is the sha256 of the seed and its id, so
//! the split depends only on (seed, ids) — not on file order, machine or library versions.

use crate::sha256_hex;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    pub train: Vec<String>,
    pub validation: Vec<String>,
}

fn rank(seed: u64, salt: &str, id: &str) -> String {
    sha256_hex(format!("{seed}\0{salt}\0{id}").as_bytes())
}

/// `val_size` ids to validation, then up to `train_size` (0 = all the rest) to training.
pub fn split(ids: &[String], seed: u64, val_size: usize, train_size: usize) -> Split {
    let mut ordered: Vec<&String> = ids.iter().collect();
    ordered.sort_by_cached_key(|id| rank(seed, "split", id));
    let val_size = val_size.min(ordered.len());
    let validation: Vec<String> = ordered[..val_size].iter().map(|s| (*s).clone()).collect();
    let rest = &ordered[val_size..];
    let take = if train_size == 0 {
        rest.len()
    } else {
        train_size.min(rest.len())
    };
    let mut train: Vec<String> = rest[..take].iter().map(|s| (*s).clone()).collect();
    train.sort();
    let mut validation = validation;
    validation.sort();
    Split { train, validation }
}

/// The training tasks of 1-based `step`: `batch_size` per step, reshuffled (by seed) each
/// pass over the data, so every task is used once per epoch.
pub fn batch(train: &[String], seed: u64, batch_size: usize, step: u32) -> Vec<String> {
    if train.is_empty() || batch_size == 0 {
        return Vec::new();
    }
    let per_epoch = train.len().div_ceil(batch_size);
    let index = (step.max(1) - 1) as usize;
    let (epoch, position) = (index / per_epoch, index % per_epoch);
    let mut order: Vec<&String> = train.iter().collect();
    order.sort_by_cached_key(|id| rank(seed, &format!("epoch{epoch}"), id));
    order
        .iter()
        .skip(position * batch_size)
        .take(batch_size)
        .map(|s| (*s).clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("task-{i}")).collect()
    }

    #[test]
    fn splits_are_disjoint_deterministic_and_order_free() {
        let a = split(&ids(50), 42, 10, 0);
        assert_eq!((a.train.len(), a.validation.len()), (40, 10));
        assert!(a.train.iter().all(|t| !a.validation.contains(t)));
        let mut reversed = ids(50);
        reversed.reverse();
        assert_eq!(split(&reversed, 42, 10, 0), a);
        assert_ne!(split(&ids(50), 7, 10, 0).validation, a.validation);
        assert_eq!(split(&ids(50), 42, 10, 5).train.len(), 5);
    }

    #[test]
    fn batches_cover_each_epoch_once() {
        let train = ids(10);
        let mut epoch: Vec<String> = (1..=4).flat_map(|s| batch(&train, 1, 3, s)).collect();
        assert_eq!(epoch.len(), 10);
        epoch.sort();
        let mut all = train.clone();
        all.sort();
        assert_eq!(epoch, all);
        assert_eq!(batch(&train, 1, 3, 2), batch(&train, 1, 3, 2));
        assert_ne!(
            batch(&train, 1, 3, 1),
            batch(&train, 1, 3, 5),
            "reshuffled next epoch"
        );
    }
}
