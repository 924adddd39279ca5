//! A tensor: row-major data and its shape. The data is host memory (`Vec<f32>`) by
//! default, or a backend's device buffer (`Tensor<B::Buf>`).

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<S = Vec<f32>> {
    pub shape: Vec<usize>,
    pub data: S,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data }
    }

    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            data: vec![0.0; shape.iter().product()],
        }
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

impl<S> Tensor<S> {
    /// Elements, from the shape (works for any storage).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The same shape with the data converted (upload, download, zero-fill).
    pub fn map<T>(&self, f: &mut impl FnMut(&Self) -> T) -> Tensor<T> {
        Tensor {
            shape: self.shape.clone(),
            data: f(self),
        }
    }
}
