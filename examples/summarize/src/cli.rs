//! Command-line interface of the summarizer.

use std::path::PathBuf;

use candle_splitkv::models::llama::{WeightForm, WeightFormPolicy};
use clap::{Parser, Subcommand, ValueEnum};
use summarize::Reduce;

pub use crate::kv_dtype::KvDtypeArg;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    F32,
    F16,
    Bf16,
}

impl DtypeArg {
    pub fn dtype(self) -> candle_core::DType {
        match self {
            DtypeArg::F32 => candle_core::DType::F32,
            DtypeArg::F16 => candle_core::DType::F16,
            DtypeArg::Bf16 => candle_core::DType::BF16,
        }
    }
}

/// Summarize a text document with a local LLM, on CPU or CUDA.
///
/// A long document is boiled down to its most salient sentences: the most central (LexRank),
/// stating names, numbers and dates no other pick states, drawn from every section and first
/// from the document's own overview. The summary is those sentences, whole, in document order;
/// with --rewrite the model compresses them a sentence or two at a time.
///
/// The rewrite contract: every sentence of a summary is a sentence of the document, or a
/// compression of exactly one: its content words stand in that sentence in the same order (a
/// change of tense or number aside), none is added, each clause is kept or dropped whole, and
/// the numbers of each of its clauses come from one clause of the source. Every sentence the
/// model writes is checked; one that breaks the contract gives way to the document's own
/// sentence.
///
/// The model counts the tokens; it writes only with --rewrite, and reads for --salience
/// attention. A document it does not read (the default model reads English) is never
/// rewritten. With no --model, the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB) is
/// downloaded on first use.
#[derive(Debug, Parser)]
#[command(name = "summarize", subcommand_negates_reqs = true)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// The documents to summarize (UTF-8 text or Markdown): files, folders (their .md and .txt
    /// files), or `-` to read one from standard input. Several are summarized at once.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,

    /// A GGUF file, or a Hugging Face model directory (config.json, tokenizer.json,
    /// *.safetensors). Default: SmolLM2-135M-Instruct, fetched into the cache on first use.
    #[arg(long, value_name = "PATH", conflicts_with = "model_id")]
    pub model: Option<PathBuf>,

    /// A model on the Hugging Face hub, e.g. `Qwen/Qwen2.5-0.5B-Instruct`: fetched into the hub's
    /// cache (`$HF_HOME`), an HF directory unless --gguf-file names one GGUF file of the repo.
    #[arg(long, value_name = "REPO")]
    pub model_id: Option<String>,

    /// The branch, tag or commit of --model-id (default: its main branch).
    #[arg(long, requires = "model_id")]
    pub revision: Option<String>,

    /// A GGUF file of --model-id to fetch and run, instead of its HF directory.
    #[arg(long, value_name = "FILE", requires = "model_id")]
    pub gguf_file: Option<String>,

    /// Where to run the model. Default: cuda when built with the `cuda` feature and a GPU is
    /// present, otherwise cpu.
    #[arg(long, value_enum)]
    pub device: Option<DeviceArg>,

    /// Attention used while decoding: the crate's split-KV kernel, or the naive reference.
    #[arg(long, value_enum, default_value_t = AttentionArg::Splitkv)]
    pub attention: AttentionArg,

    /// The dtype the model computes in. Default: f32 on the CPU; on CUDA the checkpoint's
    /// torch_dtype for HF directories, bf16 (dense, fused kernels) for GGUF models of up to 1 GiB
    /// of bf16 layer weights and f32 for larger ones.
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub dtype: Option<DtypeArg>,

    /// How the KV cache stores keys and values. fp8 (e4m3, scale 1) takes half the bytes of bf16
    /// per position, with 3 mantissa bits; keys and values beyond ±448 saturate. Default: the
    /// dtype the model computes in (--dtype).
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub kv_dtype: Option<KvDtypeArg>,

    /// The form quantized weights are multiplied in. `measure` times the candidates at load and
    /// keeps the fastest, so on a busy machine two runs may pick different forms, whose
    /// roundings differ; a fixed form makes greedy output reproducible from run to run.
    #[arg(long, value_enum, default_value_t = WeightFormArg::Measure)]
    pub weight_form: WeightFormArg,

    /// On CUDA, capture each decode step as a CUDA graph and replay it: one launch per token
    /// instead of hundreds, with the same logits. `--cuda-graph false` launches every kernel.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub cuda_graph: bool,

    /// The most tokens of the final summary; summaries of chunks get half as many, and no more
    /// than a chunk. A document no longer than this is summarized at once.
    #[arg(long, default_value_t = 400)]
    pub max_new_tokens: usize,

    /// Sampling temperature; 0 picks the most likely token every time (reproducible output).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f64,

    /// Seed of the sampler, used when --temperature is above 0.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// With --temperature above 0, sample only among the K most likely tokens.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,

    /// With --temperature above 0, sample only among the most likely tokens whose probabilities
    /// add up to P (nucleus sampling), in (0, 1]. With --top-k too, top-k applies first.
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,

    /// How many of the latest generated tokens the repeat penalty looks at.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub repeat_last_n: usize,

    /// Penalty on tokens the summary already used (1 disables it); keeps small models from looping.
    #[arg(long, default_value_t = 1.1, allow_negative_numbers = true)]
    pub repeat_penalty: f32,

    /// Speculative decoding: up to N tokens drafted per pass by looking the text so far up in
    /// the prompt (no second model), checked in one pass of the model; at most 15. Greedy output
    /// is the same either way. It writes answers one at a time, so it is off (0) by default,
    /// where answers are written in batches (faster still); with --batch 1 or an fp8 cache, 2 to
    /// 6 decodes about 1.5 times as fast on the CPU.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub speculate: usize,

    /// Answers written at once: the parts of a document (and with several documents, all their
    /// answers) decode together in one batched pass per token over a paged cache, as they come
    /// and go. 1 writes them one at a time, as does an fp8 KV cache (which pages do not hold).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub batch: usize,

    /// The most tokens of the document (or of its selected sentences) the model reads at a time.
    /// Longer documents are split into chunks of at most this size (smaller still if the model's
    /// context requires it). The default, a sentence or two, is what a small model rewrites
    /// without dropping or mixing up facts; larger chunks lose more of them.
    #[arg(long, default_value_t = 64)]
    pub chunk_tokens: usize,

    /// A document longer than this many tokens is summarized from its sentences that state the
    /// most names, numbers and dates, up to this many tokens of them; 0 summarizes it whole.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub select_tokens: usize,

    /// How the summaries of the chunks become the final summary: `carry-facts` keeps their
    /// sentences with the most names, numbers and dates, up to --max-new-tokens; `summarize`
    /// has the model summarize them again.
    #[arg(long, value_enum, default_value_t = ReduceArg::CarryFacts)]
    pub reduce: ReduceArg,

    /// What selection weighs besides the text: `text` alone (centrality, new names, numbers and
    /// distinctive terms, the overview), or also `attention`, the attention the model pays each
    /// sentence when asked after them for the document's most important facts (the model reads
    /// the 2,048 tokens of sentences the text ranks first, then picks among them). Not for a
    /// document the model does not read.
    #[arg(long, value_enum, default_value_t = SalienceArg::Text)]
    pub salience: SalienceArg,

    /// Have the model rewrite the selected sentences, a chunk of --chunk-tokens at a time; a
    /// rewrite that keeps the rewrite contract and is shorter than its sentence takes its place.
    /// Off by default: on the evaluation set it changed no recalled fact and took most of the
    /// time. A document the model does not read is never rewritten.
    #[arg(long, conflicts_with = "extractive")]
    pub rewrite: bool,

    /// Summarize from whole sentences of the document, with no generation: the default (see
    /// --rewrite).
    #[arg(long)]
    pub extractive: bool,

    /// A JSON list of facts planted in the document (`{"facts": [{"fact": ..., "forms": [...]}]}`):
    /// the statistics then say how many of them the summary recalls, and which numbers and
    /// names it states that the document does not.
    #[arg(long, value_name = "FILE")]
    pub facts: Option<PathBuf>,

    /// Print one JSON object with the summary and the statistics on stdout, instead of streaming
    /// the summary as text.
    #[arg(long)]
    pub json: bool,

    /// No progress bar, no notices and no statistics line on stderr; errors are still reported.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Score the summarizer on documents with planted facts (by default, with the model's
    /// attention salience, and with its rewrites), against four extractive baselines at the
    /// default summary's word count (lead, TF-IDF centroid, TextRank, LexRank), and print one
    /// table. Each document NAME.md or NAME.txt needs its facts in NAME.facts.json beside it;
    /// documents are grouped by their folder. The model options before `eval` apply, except
    /// --rewrite, --extractive and --salience, which the three runs set.
    Eval {
        /// Documents, or folders of them (and of folders one level down).
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,

        /// Also write every summary and score to this JSON file.
        #[arg(long, value_name = "FILE")]
        raw: Option<PathBuf>,

        /// Score the default summary and the baselines only, leaving out the two runs that use
        /// the model (its attention, its rewrites): seconds instead of minutes.
        #[arg(long)]
        text_only: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WeightFormArg {
    /// Time the candidates on the CPU and keep the fastest; as stored on a GPU.
    Measure,
    /// The GGUF storage type.
    AsStored,
    /// Requantized to Q8_0.
    #[value(name = "q8-0")]
    Q8_0,
    /// Dequantized to dense f32.
    DenseF32,
}

impl WeightFormArg {
    pub fn policy(self) -> WeightFormPolicy {
        match self {
            Self::Measure => WeightFormPolicy::Measure,
            Self::AsStored => WeightFormPolicy::Fixed(WeightForm::AsStored),
            Self::Q8_0 => WeightFormPolicy::Fixed(WeightForm::Q8_0),
            Self::DenseF32 => WeightFormPolicy::Fixed(WeightForm::DenseF32),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SalienceArg {
    Text,
    Attention,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReduceArg {
    CarryFacts,
    Summarize,
}

impl ReduceArg {
    pub fn reduce(self) -> Reduce {
        match self {
            Self::CarryFacts => Reduce::CarryFacts,
            Self::Summarize => Reduce::Summarize,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttentionArg {
    Splitkv,
    Naive,
}
