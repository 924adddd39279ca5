//! Learning-rate schedule: linear warm-up, then constant or cosine decay to a floor.

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decay {
    Constant,
    /// Cosine from the peak to `min_ratio` × peak at `total_steps`.
    Cosine {
        min_ratio: f64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub peak: f64,
    pub warmup_steps: u32,
    pub total_steps: u32,
    pub decay: Decay,
}

impl LrSchedule {
    /// The rate for 1-based `step`.
    pub fn at(&self, step: u32) -> f64 {
        if self.warmup_steps > 0 && step <= self.warmup_steps {
            return self.peak * f64::from(step) / f64::from(self.warmup_steps);
        }
        match self.decay {
            Decay::Constant => self.peak,
            Decay::Cosine { min_ratio } => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
                let progress =
                    (f64::from(step.saturating_sub(self.warmup_steps)) / f64::from(span)).min(1.0);
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                self.peak * (min_ratio + (1.0 - min_ratio) * cosine)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = LrSchedule {
            peak: 1e-3,
            warmup_steps: 4,
            total_steps: 14,
            decay: Decay::Cosine { min_ratio: 0.1 },
        };
        assert!((s.at(1) - 2.5e-4).abs() < 1e-12);
        assert!((s.at(4) - 1e-3).abs() < 1e-12);
        assert!((s.at(9) - 1e-3 * (0.1 + 0.9 * 0.5)).abs() < 1e-12); // halfway
        assert!((s.at(14) - 1e-4).abs() < 1e-12);
        assert!((s.at(40) - 1e-4).abs() < 1e-12);
        let c = LrSchedule {
            peak: 1e-3,
            warmup_steps: 0,
            total_steps: 10,
            decay: Decay::Constant,
        };
        assert_eq!(c.at(1), 1e-3);
    }
}
