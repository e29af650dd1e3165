//! The Hugging Face loader: a safetensors file with Qwen3-MoE or Mixtral names, written
//! here, loads into our flat layout exactly (split and interleaved gate/up), and the loaded
//! block computes what the HF block computes (written per expert with the HF tensors,
//! relative error < 1e-4); a missing tensor is an error naming it.

mod common;

use candle::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use common::{assert_close, uniform};
use moefuse::{GateUpLayout, MoeConfig};
use moefuse_candle::{
    candle_ops, load_mixtral, load_qwen3_moe, mixtral_config, qwen3_moe_config, HfNaming, MoeBlock,
};
use moefuse_testkit::Rng;
use std::collections::HashMap;
use std::path::PathBuf;

/// Random HF tensors of `cfg` under `prefix`, by name.
fn hf_tensors(
    cfg: &MoeConfig,
    naming: HfNaming,
    prefix: &str,
    seed: u64,
) -> HashMap<String, Tensor> {
    let (d, i, dev) = (cfg.hidden, cfg.intermediate, Device::Cpu);
    let mut rng = Rng::new(seed);
    let mut map = HashMap::new();
    map.insert(
        naming.router(prefix),
        uniform(&mut rng, &[cfg.experts, d], 0.2, &dev),
    );
    for e in 0..cfg.experts {
        let [g, u, dn] = naming.expert(prefix, e);
        map.insert(g, uniform(&mut rng, &[i, d], 0.1, &dev));
        map.insert(u, uniform(&mut rng, &[i, d], 0.1, &dev));
        map.insert(dn, uniform(&mut rng, &[d, i], 0.1, &dev));
    }
    map
}

/// Writes `map` to a fresh safetensors file and returns a VarBuilder over what it reads back.
fn through_file(map: &HashMap<String, Tensor>, name: &str, dtype: DType) -> VarBuilder<'static> {
    let dir: PathBuf = std::env::temp_dir().join(format!("moefuse-candle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.safetensors"));
    candle::safetensors::save(map, &path).unwrap();
    let loaded = candle::safetensors::load(&path, &Device::Cpu).unwrap();
    std::fs::remove_file(&path).unwrap();
    VarBuilder::from_tensors(loaded, dtype, &Device::Cpu)
}

/// Checks every expert's rows of the loaded flat weight against the HF tensors.
fn check_layout(block: &MoeBlock, map: &HashMap<String, Tensor>, naming: HfNaming, prefix: &str) {
    let cfg = block.config();
    let i = cfg.intermediate;
    let gate_up = block.gate_up().unwrap();
    let down = block.down().unwrap();
    let exact = |a: &Tensor, b: &Tensor, what: &str| {
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{what}");
    };
    exact(
        block.router().as_tensor(),
        &map[&naming.router(prefix)],
        "router",
    );
    for e in 0..cfg.experts {
        let [g, u, dn] = naming.expert(prefix, e);
        let gu = gate_up.get(e).unwrap();
        let (gate, up) = match cfg.gate_up_layout {
            GateUpLayout::Split => (gu.narrow(0, 0, i).unwrap(), gu.narrow(0, i, i).unwrap()),
            GateUpLayout::Interleaved => {
                let p = gu.reshape((i, 2, cfg.hidden)).unwrap();
                (p.get_on_dim(1, 0).unwrap(), p.get_on_dim(1, 1).unwrap())
            }
        };
        exact(&gate, &map[&g], &format!("expert {e} gate"));
        exact(&up, &map[&u], &format!("expert {e} up"));
        exact(
            &down.get(e).unwrap(),
            &map[&dn],
            &format!("expert {e} down"),
        );
    }
}

/// The HF block itself: per expert, `down(silu(gate·x) ⊙ up·x)` weighted by the routing.
fn hf_forward(
    cfg: &MoeConfig,
    map: &HashMap<String, Tensor>,
    naming: HfNaming,
    prefix: &str,
    x: &Tensor,
) -> Tensor {
    let logits = x.matmul(&map[&naming.router(prefix)].t().unwrap()).unwrap();
    let (ids, w) = candle_ops::route(cfg, &logits).unwrap();
    let (ids, w) = (ids.to_vec2::<u32>().unwrap(), w.to_vec2::<f32>().unwrap());
    let mut y = Tensor::zeros(x.dims(), DType::F32, x.device()).unwrap();
    for e in 0..cfg.experts {
        let [g, u, dn] = naming.expert(prefix, e);
        let h = (x.matmul(&map[&g].t().unwrap()).unwrap().silu().unwrap()
            * x.matmul(&map[&u].t().unwrap()).unwrap())
        .unwrap();
        let ye = h.matmul(&map[&dn].t().unwrap()).unwrap();
        let we: Vec<f32> = ids
            .iter()
            .zip(&w)
            .map(|(ri, rw)| {
                ri.iter()
                    .zip(rw)
                    .find(|(&id, _)| id as usize == e)
                    .map_or(0.0, |(_, &v)| v)
            })
            .collect();
        let we = Tensor::from_vec(we, (x.dims()[0], 1), x.device()).unwrap();
        y = (y + ye.broadcast_mul(&we).unwrap()).unwrap();
    }
    y
}

#[test]
fn qwen3_names_load_into_the_split_layout_and_compute_the_hf_block() {
    let cfg = qwen3_moe_config(64, 64, 4, 2, true).unwrap();
    let prefix = "model.layers.3";
    let map = hf_tensors(&cfg, HfNaming::Qwen3Moe, prefix, 1);
    let vb = through_file(&map, "qwen3", DType::F32);
    let block = load_qwen3_moe(&vb, &cfg, prefix).unwrap();
    assert_eq!(block.experts().dtype(), DType::F32);
    check_layout(&block, &map, HfNaming::Qwen3Moe, prefix);
    let x = uniform(&mut Rng::new(2), &[11, 64], 1.0, &Device::Cpu);
    let want = hf_forward(&cfg, &map, HfNaming::Qwen3Moe, prefix, &x);
    assert_close(
        &block.forward(&x).unwrap(),
        &want,
        1e-4,
        "qwen3 loaded block vs HF block",
    );
}

#[test]
fn mixtral_names_load_into_the_interleaved_layout_and_compute_the_hf_block() {
    let cfg = mixtral_config(64, 128, 4, 2)
        .unwrap()
        .with_gate_up_layout(GateUpLayout::Interleaved);
    let prefix = "model.layers.0";
    let map = hf_tensors(&cfg, HfNaming::Mixtral, prefix, 3);
    let vb = through_file(&map, "mixtral", DType::F32);
    let block = load_mixtral(&vb, &cfg, prefix).unwrap();
    check_layout(&block, &map, HfNaming::Mixtral, prefix);
    let x = uniform(&mut Rng::new(4), &[7, 64], 1.0, &Device::Cpu);
    let want = hf_forward(&cfg, &map, HfNaming::Mixtral, prefix, &x);
    assert_close(
        &block.forward(&x).unwrap(),
        &want,
        1e-4,
        "mixtral loaded block vs HF block",
    );
}

#[test]
fn the_builders_dtype_is_the_experts_and_the_router_stays_f32() {
    let cfg = qwen3_moe_config(64, 64, 2, 1, true).unwrap();
    let map = hf_tensors(&cfg, HfNaming::Qwen3Moe, "", 5);
    let vb = through_file(&map, "bf16", DType::BF16);
    let block = load_qwen3_moe(&vb, &cfg, "").unwrap();
    assert_eq!(block.experts().dtype(), DType::BF16);
    assert_eq!(block.router().dtype(), DType::F32);
}

#[test]
fn a_missing_or_misshapen_tensor_is_an_error_naming_it() {
    let cfg = qwen3_moe_config(64, 64, 4, 2, true).unwrap();
    let map = hf_tensors(&cfg, HfNaming::Qwen3Moe, "model.layers.0", 6);
    let vb = through_file(&map, "missing", DType::F32);
    let five = qwen3_moe_config(64, 64, 5, 2, true).unwrap();
    let err = load_qwen3_moe(&vb, &five, "model.layers.0")
        .err()
        .expect("5 experts cannot load from 4");
    assert!(
        err.to_string().contains("mlp.gate.weight") || err.to_string().contains("experts.4"),
        "{err}"
    );
    let wide = qwen3_moe_config(64, 128, 4, 2, true).unwrap();
    let err = load_qwen3_moe(&vb, &wide, "model.layers.0")
        .err()
        .expect("I = 128 cannot load from I = 64");
    assert!(err.to_string().contains("gate_proj"), "{err}");
    let err = load_mixtral(&vb, &cfg, "model.layers.0")
        .err()
        .expect("no Mixtral names here");
    assert!(err.to_string().contains("block_sparse_moe"), "{err}");
}
