//! ZeRO: each rank of the world (SP × DP: SP ranks hold identical parameters, so they share
//! the parts too) keeps only its part of the training state, by the one partition
//! `ulysses_core::zero::Partition` states. In the order a step's data pass through it:
//!
//! - [`parts`]: a rank's parts of parameters and gradients, and the collectives that move them
//!   (gradients reduce-scattered in buckets, parts all-gathered back into whole parameters);
//! - [`host_adamw`]: [`ShardedAdamW`], the optimizer's state (f32 master weights and AdamW
//!   moments) in parts on the host, updated there (`--offload-optimizer`);
//! - [`device_adamw`]: [`DeviceShardedAdamW`], the same state in parts on the device;
//! - [`stage3`]: [`ShardedParameters`], ZeRO stage 3: the compute copy of the parameters in parts
//!   too, each layer all-gathered for its pieces and its gradients reduce-scattered as they are
//!   made (`--zero 3`);
//! - [`state_files`]: the optimizer state's files, one per rank, and the training checkpoint made
//!   of them, loadable at any world size.

mod device_adamw;
mod host_adamw;
mod parts;
mod stage3;
mod state_files;

pub use device_adamw::DeviceShardedAdamW;
pub(crate) use parts::norm_of_parts;
pub use host_adamw::{PartChecks, ShardedAdamW, adamw_settings, cast_master_part, host_adamw_config};
pub use stage3::{GradParts, OptimizerPlace, PartOptimizer, PartsFrom, ShardedParameters, Zero3Step};
pub use state_files::{
    STATE_FOLDER_PREFIX, ShardedState, check_folder_shared, load_sharded_optimizer, load_sharded_optimizer_on_device, load_sharded_training_checkpoint, remove_unnamed_state_folders, save_sharded_training_checkpoint, sharded_state_file, sharded_state_folder,
};
