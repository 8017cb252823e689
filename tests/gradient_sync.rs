//! Gradient synchronisation over 3 in-process ranks: every parameter's gradient becomes the
//! sum of the ranks' gradients, whatever the bucket size, and the bucket size sets how many
//! all-reduces run. A layer that only rank 0 uses still gets the sum on every rank; a layer
//! no rank uses gets no gradient and costs no traffic.

use burn::{
    backend::{Autodiff, NdArray},
    module::{Module, ModuleVisitor, Param},
    nn::{Linear, LinearConfig},
    optim::GradientsParams,
    tensor::{DType, FloatDType, Tensor, backend::Backend},
};
use burn_ulysses::{comm::{Communicator, ThreadGroup}};
use ulysses_training::all_reduce_gradients_in_buckets;
use ulysses_suite::{max_abs_diff, uniform_tensor, values};

type Inner = NdArray<f32>;
/// The autodiff backend the ranks train on.
type Ad = Autodiff<Inner>;

const RANKS: usize = 3;
/// f32 sums of three values in a different order than the reference's.
const TOLERANCE: f32 = 1e-6;

// burn's Module derive expects the backend parameter to be called `B`.
#[derive(Module, Debug)]
struct Net<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
    only_rank_0: Linear<B>,
    unused: Linear<B>,
}

impl<B: Backend> Net<B> {
    fn new(device: &B::Device) -> Self {
        let linear = |d_in, d_out| LinearConfig::new(d_in, d_out).init(device);
        // Each rank initialises its own values: the reference is the sum of the ranks' own gradients.
        Self { first: linear(8, 16), second: linear(16, 4), only_rank_0: linear(4, 4), unused: linear(4, 4) }
    }

    fn loss(&self, rank: usize) -> Tensor<B, 1> {
        let device = self.first.weight.val().device();
        let x = uniform_tensor::<B, 2>([5, 8], 100 + rank as u64, &device);
        let mut y = self.second.forward(self.first.forward(x).tanh());
        if rank == 0 {
            y = self.only_rank_0.forward(y);
        }
        (y.clone() * y).sum()
    }
}

/// Each parameter's gradient (None when it has none), in module order.
fn grads_in_order(net: &Net<Ad>, grads: &GradientsParams) -> Vec<Option<Vec<f32>>> {
    struct Read<'a>(&'a GradientsParams, Vec<Option<Vec<f32>>>);
    impl ModuleVisitor<Ad> for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
            self.1.push(self.0.get::<Inner, D>(param.id).map(values));
        }
    }
    let mut read = Read(grads, Vec::new());
    net.visit(&mut read);
    read.1
}

struct RankOutcome {
    local: Vec<Option<Vec<f32>>>,
    reduced: Vec<Option<Vec<f32>>>,
    all_reduce_calls: u64,
}

fn run(bucket_bytes: usize) -> Vec<RankOutcome> {
    ThreadGroup::new(RANKS)
        .run(|rank| {
            let communicator = rank.communicator();
            let net = Net::<Ad>::new(&Default::default());
            let grads = GradientsParams::from_grads::<Ad, _>(net.loss(rank.rank()).backward(), &net);
            let local = grads_in_order(&net, &grads);
            let before = Communicator::<Inner>::traffic(&*communicator);
            let grads = all_reduce_gradients_in_buckets::<Ad, _>(&net, grads, &*communicator, bucket_bytes).unwrap();
            let all_reduce_calls = Communicator::<Inner>::traffic(&*communicator).since(&before).all_reduce_calls;
            RankOutcome { local, reduced: grads_in_order(&net, &grads), all_reduce_calls }
        })
        .into_iter()
        .map(|outcome| outcome.unwrap())
        .collect()
}

/// The reference: each parameter's local gradients summed over ranks on the host.
fn check_sums(outcomes: &[RankOutcome]) {
    let parameters = outcomes[0].local.len();
    for p in 0..parameters {
        let locals: Vec<&Vec<f32>> = outcomes.iter().filter_map(|o| o.local[p].as_ref()).collect();
        if locals.is_empty() {
            for outcome in outcomes {
                assert!(outcome.reduced[p].is_none(), "parameter {p} has no gradient on any rank but got one");
            }
            continue;
        }
        let sum = ulysses_suite::sum_vectors(locals);
        for (rank, outcome) in outcomes.iter().enumerate() {
            let got = outcome.reduced[p].as_ref().unwrap_or_else(|| panic!("rank {rank} lost parameter {p}'s gradient"));
            let diff = max_abs_diff(got, &sum);
            assert!(diff <= TOLERANCE, "rank {rank}, parameter {p}: |Δ| {diff:e} from the sum of the ranks' gradients");
        }
    }
}

#[test]
fn one_large_bucket_sums_every_gradient_in_one_all_reduce() {
    let outcomes = run(1 << 20);
    check_sums(&outcomes);
    assert!(outcomes.iter().all(|o| o.all_reduce_calls == 1), "one bucket, one all-reduce");
}

#[test]
fn small_buckets_give_the_same_sums_in_more_all_reduces() {
    // Gradient bytes in module order: first 512 + 64, second 256 + 16, only_rank_0 64 + 16;
    // the unused layer has none anywhere. A 300-byte cap fills [512] [64] [256, 16] [64, 16].
    let outcomes = run(300);
    check_sums(&outcomes);
    assert!(outcomes.iter().all(|o| o.all_reduce_calls == 4), "calls: {:?}", outcomes.iter().map(|o| o.all_reduce_calls).collect::<Vec<_>>());
    let one_per_parameter = run(1);
    check_sums(&one_per_parameter);
    assert!(one_per_parameter.iter().all(|o| o.all_reduce_calls == 6), "six parameters with a gradient somewhere, one all-reduce each");
}

#[test]
fn a_layer_used_on_one_rank_only_gets_the_sum_on_every_rank() {
    let outcomes = run(1 << 20);
    // only_rank_0 (parameters 4 and 5) has a local gradient on rank 0 alone.
    assert!(outcomes[0].local[4].is_some() && outcomes[1].local[4].is_none());
    assert!(outcomes.iter().all(|o| o.reduced[4].is_some() && o.reduced[5].is_some()));
    // The unused layer (6 and 7): no gradient anywhere, none invented.
    assert!(outcomes.iter().all(|o| o.reduced[6].is_none() && o.reduced[7].is_none()));
    check_sums(&outcomes);
}

/// Gradients of another dtype than their parameters', as a half-precision compute copy's summed
/// in f32 are (`with_parameters_in` beside the step's f32 gradient sums; here the parameters are
/// f64, which NdArray holds where it holds no f16): a rank without a layer's gradient sends zeros
/// of the gradients' dtype, and every rank gets the sum in it. Its zeros used to be made in the
/// parameter's dtype, which the gradients beside them in a bucket could not be joined with.
#[test]
fn gradients_of_another_dtype_than_their_parameters_are_summed_in_theirs() {
    let outcomes: Vec<RankOutcome> = ThreadGroup::new(RANKS)
        .run(|rank| {
            let communicator = rank.communicator();
            let net = Net::<Ad>::new(&Default::default());
            let grads = GradientsParams::from_grads::<Ad, _>(net.loss(rank.rank()).backward(), &net);
            let local = grads_in_order(&net, &grads);
            let other = ulysses_training::with_parameters_in(net.clone(), FloatDType::F64);
            let grads = all_reduce_gradients_in_buckets::<Ad, _>(&other, grads, &*communicator, 1 << 20).unwrap();
            for (index, grad) in grads_dtypes(&other, &grads).into_iter().enumerate() {
                assert!(grad.is_none_or(|dtype| dtype == DType::F32), "rank {}: parameter {index}'s sum is {grad:?}, not f32", rank.rank());
            }
            RankOutcome { local, reduced: grads_in_order(&net, &grads), all_reduce_calls: 0 }
        })
        .into_iter()
        .map(|outcome| outcome.unwrap())
        .collect();
    assert!(outcomes[1].local[4].is_none(), "rank 1 has no gradient of only_rank_0: it sends zeros");
    check_sums(&outcomes);
}

/// Each parameter's gradient dtype (None when it has none), in module order.
fn grads_dtypes(net: &Net<Ad>, grads: &GradientsParams) -> Vec<Option<DType>> {
    struct Read<'a>(&'a GradientsParams, Vec<Option<DType>>);
    impl ModuleVisitor<Ad> for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
            self.1.push(self.0.get::<Inner, D>(param.id).map(|grad| grad.dtype()));
        }
    }
    let mut read = Read(grads, Vec::new());
    net.visit(&mut read);
    read.1
}

/// Every gradient of `net` in `grads`, flattened in module order.
fn gradient_values(net: &Net<Ad>, grads: &GradientsParams) -> Vec<f32> {
    grads_in_order(net, grads).into_iter().flatten().flatten().collect()
}

/// The global norm is the L2 norm of every gradient as one vector (against an f64 sum of the
/// values); clipping to a quarter of it scales every gradient by `max / (norm + 1e-6)`, as
/// `torch.nn.utils.clip_grad_norm_`, and leaves them bit for bit when the norm is below the
/// limit. A parameter without a gradient (`unused`) counts for nothing.
#[test]
fn clipping_scales_the_whole_gradient_to_the_global_norm_asked_for() {
    use ulysses_training::{clip_gradient_norm, gradient_norm};
    let device = Default::default();
    let net = Net::<Ad>::new(&device);
    // Rank 0's loss: every layer but `unused` has a gradient.
    let gradients = || GradientsParams::from_grads(net.loss(0).backward(), &net);
    let grads = gradients();
    let original = gradient_values(&net, &grads);
    let expected_norm = original.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>().sqrt();

    let norm = gradient_norm(&net, &grads);
    assert!((norm - expected_norm).abs() <= 1e-6 * expected_norm, "norm {norm} against {expected_norm}");

    let (kept, before) = clip_gradient_norm(&net, gradients(), 2.0 * norm).unwrap();
    assert_eq!(before, norm);
    assert!(gradient_values(&net, &kept) == original, "a gradient below the limit changed");

    let (clipped, _) = clip_gradient_norm(&net, grads, norm / 4.0).unwrap();
    let factor = (norm / 4.0) / (norm + 1e-6);
    let scaled: Vec<f32> = original.iter().map(|&g| (g as f64 * factor) as f32).collect();
    let difference = max_abs_diff(&gradient_values(&net, &clipped), &scaled);
    assert!(difference <= TOLERANCE * norm as f32, "clipped gradients differ from the scaled ones by {difference}");
    let clipped_norm = gradient_norm(&net, &clipped);
    assert!((clipped_norm - norm / 4.0).abs() <= 1e-5 * norm, "clipped to {clipped_norm}, asked for {}", norm / 4.0);
    // A limit not above 0 is refused: 0 zeroed the gradient, -1 turned it around, NaN clipped nothing.
    for limit in [0.0, -1.0, f64::NAN] {
        let refused = clip_gradient_norm(&net, gradients(), limit).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains(&format!("max_grad_norm is {limit};")), "limit {limit}: {refused}");
    }
}

/// Gradients of 1e20 (a diverging run) square past f32's range: the norm is still theirs
/// (summed scaled, not infinite), so clipping scales them to the limit instead of zeroing them.
#[test]
fn a_gradient_whose_squares_overflow_f32_keeps_its_norm() {
    use ulysses_training::{clip_gradient_norm, gradient_norm};
    let net = Net::<Ad>::new(&Default::default());
    let gradients = || GradientsParams::from_grads((net.loss(0) * 1e20).backward(), &net);
    let original = gradient_values(&net, &gradients());
    assert!(original.iter().all(|g| g.is_finite()) && original.iter().any(|g| g.abs() > 1.9e19), "the gradients must be finite and square past f32");
    let expected_norm = original.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>().sqrt();
    let norm = gradient_norm(&net, &gradients());
    assert!((norm - expected_norm).abs() <= 1e-5 * expected_norm, "norm {norm} against {expected_norm}");
    let (clipped, _) = clip_gradient_norm(&net, gradients(), 1.0).unwrap();
    let clipped_norm = gradient_norm(&net, &clipped);
    assert!((clipped_norm - 1.0).abs() <= 1e-4, "clipped to {clipped_norm}, asked for 1");
}

/// After the all-reduce every rank holds the same gradient bits, but a GPU's sum of their
/// squares can differ in its last bits from rank to rank (burn's CubeCL sum adds partial sums
/// with atomics, in f32), and clipping factors that far apart made an H100's SP=2 ranks'
/// parameters part ways. Every rank clips with rank 0's norm: here rank `r` measured rank 0's
/// norm times `1 + r·1e-6` (an f32 sum in another order), and every rank gets rank 0's, so the
/// clipped gradients are bit-identical.
#[test]
fn every_rank_clips_with_rank_0s_gradient_norm() {
    use ulysses_training::{agreed_gradient_norm, clip_with_norm, gradient_norm};
    let outcomes = ThreadGroup::new(RANKS)
        .run(|rank| {
            let communicator = rank.communicator();
            // The same parameters and gradients on every rank, as after the all-reduce.
            let net = ulysses_training::broadcast_parameters(Net::<Ad>::new(&Default::default()), &*communicator).unwrap();
            let grads = GradientsParams::from_grads::<Ad, _>(net.loss(0).backward(), &net);
            // The limit is the same on every rank, as a run's is.
            let exact = gradient_norm(&net, &grads);
            let measured = exact * (1.0 + 1e-6 * rank.rank() as f64);
            let agreed = agreed_gradient_norm::<Inner>(measured, &*communicator).unwrap();
            let clipped = clip_with_norm(&net, grads, agreed, exact / 4.0).unwrap();
            (measured, agreed, gradient_values(&net, &clipped))
        })
        .into_iter()
        .map(|outcome| outcome.unwrap())
        .collect::<Vec<_>>();
    let (rank_0_norm, _, rank_0_clipped) = &outcomes[0];
    assert!(rank_0_norm.is_finite() && *rank_0_norm > 0.0, "rank 0 measured a norm of {rank_0_norm}");
    assert!(rank_0_clipped.iter().all(|g| g.is_finite()), "rank 0's clipped gradients hold a NaN or an infinity");
    assert!(outcomes[1].0 != *rank_0_norm, "the ranks were meant to measure different norms");
    for (rank, (_, agreed, clipped)) in outcomes.iter().enumerate() {
        assert_eq!(agreed.to_bits(), rank_0_norm.to_bits(), "rank {rank} clips with {agreed}, rank 0 with {rank_0_norm}");
        assert!(clipped.iter().zip(rank_0_clipped).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {rank}'s clipped gradients differ from rank 0's");
    }
}
