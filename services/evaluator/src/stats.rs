//! The statistics of an evaluation: the resolution rate with a Wilson score interval and
//! unbiased pass@k (Chen et al., 2021).

/// The 95% Wilson score interval of `successes` out of `trials` (the whole [0, 1] when
/// nothing was measured).
pub fn wilson95(successes: u32, trials: u32) -> (f64, f64) {
    if trials == 0 {
        return (0.0, 1.0);
    }
    let z = 1.959_963_984_540_054_f64;
    let n = f64::from(trials);
    let p = f64::from(successes) / n;
    let denominator = 1.0 + z * z / n;
    let center = (p + z * z / (2.0 * n)) / denominator;
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / denominator;
    ((center - half).max(0.0), (center + half).min(1.0))
}

/// Unbiased pass@k of one task with `correct` of `samples` resolved:
/// 1 - C(samples - correct, k) / C(samples, k), as a stable product.
pub fn pass_at_k(samples: u32, correct: u32, k: u32) -> f64 {
    if k == 0 || k > samples {
        return f64::NAN;
    }
    if samples - correct < k {
        return 1.0;
    }
    let mut none = 1.0;
    for i in (samples - correct + 1)..=samples {
        none *= 1.0 - f64::from(k) / f64::from(i);
    }
    1.0 - none
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_matches_reference_values() {
        // statsmodels proportion_confint(8, 10, method="wilson"): (0.4902, 0.9433).
        let (lo, hi) = wilson95(8, 10);
        assert!(
            (lo - 0.4902).abs() < 1e-4 && (hi - 0.9433).abs() < 1e-4,
            "{lo} {hi}"
        );
        // (0, 20): (0, 0.1611).
        let (lo, hi) = wilson95(0, 20);
        assert!(lo == 0.0 && (hi - 0.1611).abs() < 1e-4, "{hi}");
        assert_eq!(wilson95(0, 0), (0.0, 1.0));
    }

    #[test]
    fn pass_at_k_is_the_unbiased_estimator() {
        // n = 4, c = 1: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5.
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-12);
        assert!((pass_at_k(4, 1, 2) - 0.5).abs() < 1e-12);
        // c = 2, k = 3: 1 - C(2,3)/C(4,3) = 1 (fewer failures than k).
        assert_eq!(pass_at_k(4, 2, 3), 1.0);
        assert_eq!(pass_at_k(4, 0, 4), 0.0);
        // n = 10, c = 3, k = 5: 1 - C(7,5)/C(10,5) = 1 - 21/252.
        assert!((pass_at_k(10, 3, 5) - (1.0 - 21.0 / 252.0)).abs() < 1e-12);
    }
}
