//! Reads `kernels/kernels.toml`, the one declaration of every kernel form, and generates:
//!
//! - always, `limits.rs`: the head dims and query tokens per sequence the op accepts;
//! - with the `cuda` feature, each form's variant traits (its values on the feature axes, as named
//!   flags its kernel takes), the kernel instances (one `.cu` per module and dtype), a fatbin of
//!   each (nvcc: machine code for the target, and the PTX so that newer GPUs can run it), and
//!   `kernel_table.rs`: the form enum, the table of instances with the threads and shared memory
//!   the compiler evaluated from the kernels' headers, and the Rust twins of the launch parameter
//!   blocks, enums and constants, each checked against the compiler's layout.
//!
//! Without the feature nothing needs a CUDA toolkit. With `CANDLE_SPLITKV_PTX_ONLY=1` the fatbins
//! hold the PTX alone: the build skips the machine-code compiler (ptxas), and the driver compiles
//! each module when a process first loads it.

use std::collections::BTreeMap;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde::Deserialize;

const KERNEL_DIR: &str = "kernels";
const SPEC: &str = "kernels/kernels.toml";
/// Set to 1 to build PTX without machine code (see the top of this file).
const PTX_ONLY_VAR: &str = "CANDLE_SPLITKV_PTX_ONLY";
/// Compute capabilities, comma-separated, to compile the kernels for as well, to PTX that is
/// thrown away: one build checks that every target builds (CI).
const CHECK_CAPS_VAR: &str = "CANDLE_SPLITKV_CHECK_COMPUTE_CAPS";
/// The oldest target the kernels are written for.
const MIN_COMPUTE_CAP: u32 = 80;

#[derive(Deserialize)]
struct Spec {
    head_dims: Vec<usize>,
    max_query_tokens: usize,
    #[serde(default)]
    axis: Vec<Axis>,
    /// Each kernel and its forms, as written: see [`expand_forms`].
    kernel: Vec<toml::Table>,
    /// Every form of every kernel, expanded.
    #[serde(skip)]
    form: Vec<Form>,
    #[serde(default)]
    params: Vec<Named>,
    #[serde(default)]
    enums: Vec<EnumSpec>,
    #[serde(default)]
    constants: Vec<ConstantSpec>,
}

/// A feature axis: a flag of the variant traits a kernel takes, `kCamelCase` of its name.
#[derive(Deserialize)]
struct Axis {
    name: String,
    doc: String,
}

impl Axis {
    fn flag(&self) -> String {
        let mut flag = String::from("k");
        for word in self.name.split('_') {
            let mut chars = word.chars();
            if let Some(first) = chars.next() {
                flag.push(first.to_ascii_uppercase());
                flag.extend(chars);
            }
        }
        flag
    }
}

/// One kernel form: its kernel's keys, overridden by its own, with its point on the axes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Form {
    name: String,
    header: String,
    module: String,
    params: String,
    /// The `__device__` function the form runs, with its template arguments: `T`, `KV`, `D`, `G`
    /// as in `threads`, and `V` for the form's variant traits.
    entry: String,
    dtypes: Vec<String>,
    /// K/V storage types besides the element type (fp8 K/V under f16/bf16 queries); a form that
    /// lists any has a `KV` template parameter, the element type itself in its plain instances.
    #[serde(default)]
    kv_dtypes: Vec<String>,
    #[serde(default)]
    head_dims: HeadDims,
    #[serde(default)]
    groups: Vec<usize>,
    /// Group bounds for a dtype whose instances need fewer than `groups` lists.
    #[serde(default)]
    dtype_groups: BTreeMap<String, Vec<usize>>,
    threads: String,
    smem: String,
    cluster_smem: Option<String>,
    /// Query rows and K/V positions of one CTA's tile, for forms whose grid the host sizes by
    /// them (C++ expressions, as `threads`).
    tile_rows: Option<String>,
    tile_keys: Option<String>,
    #[serde(default)]
    min_ctas_per_sm: MinCtas,
    #[serde(default)]
    min_compute_cap: u32,
    /// An architecture-specific target such as "90a": the form is compiled for it alone, and
    /// only in a build whose compute capability is that architecture.
    arch: Option<String>,
    /// The variant: every axis of the kernel with its value, as (flag, value, doc).
    #[serde(skip)]
    variant: Vec<(String, bool, String)>,
}

/// The head dims a form is instantiated at: `true` for every one the op takes, or a list.
#[derive(Deserialize, Default)]
#[serde(untagged)]
enum HeadDims {
    #[default]
    None,
    All(bool),
    Only(Vec<usize>),
}

/// The second argument of `__launch_bounds__`: a count, or a C++ expression of the instance.
#[derive(Deserialize, Default)]
#[serde(untagged)]
enum MinCtas {
    #[default]
    Unbounded,
    Count(u32),
    Expr(String),
}

impl MinCtas {
    fn expr(&self) -> Option<String> {
        match self {
            MinCtas::Unbounded | MinCtas::Count(0) => None,
            MinCtas::Count(n) => Some(n.to_string()),
            MinCtas::Expr(e) => Some(e.clone()),
        }
    }
}

impl Form {
    fn has_head_dims(&self) -> bool {
        !matches!(self.head_dims, HeadDims::None | HeadDims::All(false))
    }

    /// Whether a build for compute capability `cap` compiles this form.
    fn built_for(&self, cap: u32) -> bool {
        match &self.arch {
            Some(arch) => arch.trim_end_matches(char::is_alphabetic).parse() == Ok(cap),
            None => cap >= self.min_compute_cap,
        }
    }

    /// The architecture of its module: `90a`, or the build's target.
    fn target<'a>(&'a self, compute_cap: &'a str) -> &'a str {
        self.arch.as_deref().unwrap_or(compute_cap)
    }
}

#[derive(Deserialize)]
struct Named {
    name: String,
    header: String,
}

#[derive(Deserialize)]
struct EnumSpec {
    name: String,
    header: String,
    prefix: String,
}

#[derive(Deserialize)]
struct ConstantSpec {
    name: String,
    header: String,
    rust: String,
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={SPEC}");
    if let Err(message) = run() {
        // A build script reports failure by panicking; the message is what the user sees.
        panic!("\n\ncandle-splitkv: cannot build the kernels: {message}\n\n");
    }
}

fn run() -> Result<(), String> {
    let text = fs::read_to_string(SPEC).map_err(|e| format!("reading {SPEC}: {e}"))?;
    let mut spec: Spec = toml::from_str(&text).map_err(|e| format!("{SPEC}: {e}"))?;
    spec.form = expand_forms(&spec).map_err(|e| format!("{SPEC}: {e}"))?;
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    write_limits(&spec, &out_dir)?;
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return Ok(());
    }
    build_kernels(&spec, &out_dir)
}

/// Each `[[kernel]]` as its forms: the kernel's keys but `axes` and `forms`, overridden by the
/// form's own, and the form's value on each of the kernel's axes (false where it names none).
fn expand_forms(spec: &Spec) -> Result<Vec<Form>, String> {
    let mut forms: Vec<Form> = Vec::new();
    for kernel in &spec.kernel {
        let mut base = kernel.clone();
        let axes = match base.remove("axes") {
            None => Vec::new(),
            Some(toml::Value::Array(names)) => names
                .iter()
                .map(|name| {
                    spec.axis
                        .iter()
                        .find(|a| Some(a.name.as_str()) == name.as_str())
                        .ok_or_else(|| format!("{name} is not an [[axis]]"))
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => return Err(format!("`axes` lists axis names, got {other}")),
        };
        let Some(toml::Value::Array(list)) = base.remove("forms") else {
            return Err("every [[kernel]] lists its `forms` (one table each)".into());
        };
        for entry in list {
            let toml::Value::Table(mut table) = entry else {
                return Err(format!("`forms` holds tables, got {entry}"));
            };
            let name = table
                .get("name")
                .and_then(toml::Value::as_str)
                .ok_or("every form has a `name`")?
                .to_string();
            let mut variant = Vec::new();
            for axis in &axes {
                let value = match table.remove(&axis.name) {
                    None => false,
                    Some(toml::Value::Boolean(b)) => b,
                    Some(other) => {
                        return Err(format!(
                            "form {name}: axis `{}` is true or false, got {other}",
                            axis.name
                        ))
                    }
                };
                variant.push((axis.flag(), value, axis.doc.clone()));
            }
            let mut merged = base.clone();
            merged.extend(table);
            let mut form: Form = toml::Value::Table(merged).try_into().map_err(|e| {
                format!("form {name} (an axis it sets must be in its kernel's `axes`): {e}")
            })?;
            if forms.iter().any(|f| f.name == form.name) {
                return Err(format!("two forms are named {name}"));
            }
            if let Some(dtype) = form.dtype_groups.keys().find(|d| !form.dtypes.contains(d)) {
                return Err(format!(
                    "form {name}: `dtype_groups` names {dtype}, which is not one of its dtypes"
                ));
            }
            if form.dtype_groups.values().any(Vec::is_empty)
                || (!form.dtype_groups.is_empty() && form.groups.is_empty())
            {
                return Err(format!(
                    "form {name}: `dtype_groups` narrows `groups` to a non-empty list per dtype"
                ));
            }
            form.variant = variant;
            forms.push(form);
        }
    }
    Ok(forms)
}

/// The limits every backend enforces: the head dims and the query tokens per sequence.
fn write_limits(spec: &Spec, out_dir: &Path) -> Result<(), String> {
    let dims = &spec.head_dims;
    let list = dims.iter().map(usize::to_string).collect::<Vec<_>>();
    let code = format!(
        "/// Head dimensions the kernels are built for (`kernels/kernels.toml`).\n\
         pub const SUPPORTED_HEAD_DIMS: [usize; {}] = [{}];\n\
         /// Most query tokens per sequence the decode kernels take (`kernels/kernels.toml`); on \
         CUDA, calls\n/// with more run the prefill kernels.\n\
         pub const MAX_QUERY_TOKENS: usize = {};\n",
        dims.len(),
        list.join(", "),
        spec.max_query_tokens
    );
    write(&out_dir.join("limits.rs"), &code)
}

/// One compiled kernel: a form at one dtype, K/V storage type, head dim and group bound.
struct Instance<'a> {
    form: &'a Form,
    dtype: &'a str,
    /// The K/V storage type where it differs from `dtype`.
    kv_dtype: Option<&'a str>,
    head_dim: Option<usize>,
    group: Option<usize>,
}

impl Instance<'_> {
    fn symbol(&self) -> String {
        let mut s = format!("{}_{}", snake(&self.form.name), self.dtype);
        if let Some(kv) = self.kv_dtype {
            write!(s, "_kv_{kv}").unwrap();
        }
        if let Some(d) = self.head_dim {
            write!(s, "_d{d}").unwrap();
        }
        if let Some(g) = self.group {
            write!(s, "_g{g}").unwrap();
        }
        s
    }

    /// One module per (module, dtype, K/V type), so that nvcc compiles them side by side.
    fn module(&self) -> String {
        match self.kv_dtype {
            Some(kv) => format!("{}_{}_kv_{kv}", self.form.module, self.dtype),
            None => format!("{}_{}", self.form.module, self.dtype),
        }
    }

    /// The K/V storage type as a candle `DType` variant.
    fn kv_dtype_variant(&self) -> String {
        self.kv_dtype.unwrap_or(self.dtype).to_uppercase()
    }

    /// The form's wrapper struct with this instance's template arguments.
    fn wrapper(&self) -> Result<String, String> {
        let mut args = vec![cxx_type(self.dtype)?.to_string()];
        if !self.form.kv_dtypes.is_empty() {
            args.push(cxx_type(self.kv_dtype.unwrap_or(self.dtype))?.to_string());
        }
        args.extend(self.head_dim.map(|d| d.to_string()));
        args.extend(self.group.map(|g| g.to_string()));
        Ok(format!("forms::{}<{}>", self.form.name, args.join(", ")))
    }
}

fn build_kernels(spec: &Spec, out_dir: &Path) -> Result<(), String> {
    for var in [
        "NVCC",
        "CUDA_ROOT",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_COMPUTE_CAP",
        "PATH",
        PTX_ONLY_VAR,
        CHECK_CAPS_VAR,
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed={KERNEL_DIR}");
    for entry in fs::read_dir(KERNEL_DIR).map_err(|e| format!("reading {KERNEL_DIR}/: {e}"))? {
        let path = entry
            .map_err(|e| format!("reading {KERNEL_DIR}/: {e}"))?
            .path();
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let nvcc = find_nvcc()?;
    let compute_cap = compute_cap()?;
    let cap: u32 = compute_cap
        .parse()
        .map_err(|_| format!("CUDA_COMPUTE_CAP {compute_cap:?} is not a number"))?;
    if cap < MIN_COMPUTE_CAP {
        return Err(format!(
            "the kernels need compute capability {MIN_COMPUTE_CAP} or later (Ampere's \
             asynchronous copies and tensor-core instructions), the target is {cap}; GPUs before \
             Ampere (T4, V100) are not supported: build without the `cuda` feature and use the \
             CPU, or set CUDA_COMPUTE_CAP to a later GPU's"
        ));
    }

    let machine_code = match env::var(PTX_ONLY_VAR).as_deref() {
        Err(_) | Ok("" | "0") => true,
        Ok("1") => false,
        Ok(other) => return Err(format!("{PTX_ONLY_VAR} must be 0 or 1, got {other:?}")),
    };

    let instances = instances(spec, cap);
    let gen_dir = out_dir.join("kernels");
    fs::create_dir_all(&gen_dir).map_err(|e| format!("creating {}: {e}", gen_dir.display()))?;

    let modules = modules_of(&instances);
    let mut jobs = module_jobs(
        &modules,
        &compute_cap,
        (&gen_dir, out_dir),
        OutputKind::Fatbin { machine_code },
    )?;
    // The table source: resource sizes, layouts and constants as globals the PTX spells out.
    let table_source = gen_dir.join("table.cu");
    let (table_code, layouts) = table_source_code(spec, &instances)?;
    write(&table_source, &table_code)?;
    let table_ptx = gen_dir.join("table.ptx");
    // The table includes every compiled form's header, so it takes an architecture-specific
    // target where some form has one. It is read here alone, so PTX is all it needs.
    let table_target = instances
        .iter()
        .find(|i| i.form.arch.is_some())
        .map_or(compute_cap.as_str(), |i| i.form.target(&compute_cap));
    jobs.push(NvccJob {
        source: table_source,
        output: table_ptx.clone(),
        arch: table_target.to_string(),
        output_kind: OutputKind::Ptx,
    });
    for check in check_caps()? {
        jobs.extend(check_jobs(
            spec,
            check,
            &gen_dir.join(format!("check_{check}")),
        )?);
    }
    compile_all(&nvcc, &jobs)?;

    let values = ptx_globals(&table_ptx)?;
    let code = rust_table(spec, &instances, &modules, &layouts, &values)?;
    write(&out_dir.join("kernel_table.rs"), &code)?;
    println!("cargo:rustc-env=CANDLE_SPLITKV_COMPUTE_CAP={compute_cap}");
    println!("cargo:rustc-env=CANDLE_SPLITKV_MIN_COMPUTE_CAP={MIN_COMPUTE_CAP}");
    Ok(())
}

/// The targets `CANDLE_SPLITKV_CHECK_COMPUTE_CAPS` names.
fn check_caps() -> Result<Vec<u32>, String> {
    let Ok(list) = env::var(CHECK_CAPS_VAR) else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s.parse::<u32>() {
            Ok(cap) if cap >= MIN_COMPUTE_CAP => Ok(cap),
            _ => Err(format!(
                "{CHECK_CAPS_VAR}: {s:?} is not a compute capability of {MIN_COMPUTE_CAP} or later"
            )),
        })
        .collect()
}

/// PTX jobs for every module of a build for `cap`, their sources and output in `dir`.
fn check_jobs(spec: &Spec, cap: u32, dir: &Path) -> Result<Vec<NvccJob>, String> {
    fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let instances = instances(spec, cap);
    module_jobs(
        &modules_of(&instances),
        &cap.to_string(),
        (dir, dir),
        OutputKind::Ptx,
    )
}

/// The instances by module: one source per (module, dtype, K/V type), holding every form that
/// lives in it.
fn modules_of<'a>(instances: &'a [Instance<'a>]) -> BTreeMap<String, Vec<&'a Instance<'a>>> {
    let mut modules: BTreeMap<String, Vec<&Instance>> = BTreeMap::new();
    for inst in instances {
        modules.entry(inst.module()).or_default().push(inst);
    }
    modules
}

/// Writes each module's source into `source_dir` and returns the job that compiles it for
/// `compute_cap` (or its forms' own architecture) into `output_dir`.
fn module_jobs(
    modules: &BTreeMap<String, Vec<&Instance>>,
    compute_cap: &str,
    (source_dir, output_dir): (&Path, &Path),
    output_kind: OutputKind,
) -> Result<Vec<NvccJob>, String> {
    let extension = match output_kind {
        OutputKind::Ptx => "ptx",
        OutputKind::Fatbin { .. } => "fatbin",
    };
    let mut jobs = Vec::new();
    for (module, members) in modules {
        let source = source_dir.join(format!("{module}.cu"));
        write(&source, &module_source(members)?)?;
        jobs.push(NvccJob {
            output: output_dir.join(format!("{module}.{extension}")),
            source,
            arch: members[0].form.target(compute_cap).to_string(),
            output_kind,
        });
    }
    Ok(jobs)
}

fn instances(spec: &Spec, cap: u32) -> Vec<Instance<'_>> {
    let mut all = Vec::new();
    for form in spec.form.iter().filter(|f| f.built_for(cap)) {
        let dims: Vec<Option<usize>> = match &form.head_dims {
            HeadDims::All(true) => spec.head_dims.iter().copied().map(Some).collect(),
            HeadDims::Only(list) => list.iter().copied().map(Some).collect(),
            HeadDims::None | HeadDims::All(false) => vec![None],
        };
        let kv_dtypes = std::iter::once(None).chain(
            form.kv_dtypes
                .iter()
                .filter(|kv| cap >= kv_min_compute_cap(kv))
                .map(|kv| Some(kv.as_str())),
        );
        for kv_dtype in kv_dtypes {
            for dtype in &form.dtypes {
                let bounds = form.dtype_groups.get(dtype).unwrap_or(&form.groups);
                let groups: Vec<Option<usize>> = if bounds.is_empty() {
                    vec![None]
                } else {
                    bounds.iter().copied().map(Some).collect()
                };
                for &head_dim in &dims {
                    for &group in &groups {
                        all.push(Instance {
                            form,
                            dtype,
                            kv_dtype,
                            head_dim,
                            group,
                        });
                    }
                }
            }
        }
    }
    all
}

/// The template parameters of a form's wrapper: the element type, the K/V storage type, the
/// head dim and the group bound, each where the form has it.
fn wrapper_params(form: &Form) -> String {
    let mut params = vec!["typename T"];
    if !form.kv_dtypes.is_empty() {
        params.push("typename KV");
    }
    if form.has_head_dims() {
        params.push("int D");
    }
    if !form.groups.is_empty() {
        params.push("int G");
    }
    params.join(", ")
}

/// A form's variant traits as C++: a struct of its values on its kernel's axes, named after the
/// form, that the kernel takes as one template parameter; empty for a kernel without axes.
fn variant_struct(form: &Form) -> String {
    if form.variant.is_empty() {
        return String::new();
    }
    let mut code = format!("namespace variants {{\nstruct {} {{\n", form.name);
    for (flag, value, doc) in &form.variant {
        writeln!(
            code,
            "    static constexpr bool {flag} = {value};  // {doc}"
        )
        .unwrap();
    }
    code.push_str("};\n}  // namespace variants\n");
    code
}

/// A form's declaration as C++: its variant traits and a struct template that names its threads,
/// shared memory and entry point (`V` in it the variant). Included by the module sources and the
/// table source alike.
fn wrapper_struct(form: &Form) -> String {
    let cluster = form
        .cluster_smem
        .as_deref()
        .map(|e| format!("    static constexpr int kClusterSmemBytes = ({e});\n"))
        .unwrap_or_default();
    let optional = |name: &str, expr: Option<&str>| {
        expr.map(|e| format!("    static constexpr int {name} = ({e});\n"))
            .unwrap_or_default()
    };
    let tile = optional("kTileRows", form.tile_rows.as_deref())
        + &optional("kTileKeys", form.tile_keys.as_deref())
        + &optional("kMinCtasPerSm", form.min_ctas_per_sm.expr().as_deref());
    let variant = if form.variant.is_empty() {
        String::new()
    } else {
        format!("    using V = variants::{};\n", form.name)
    };
    format!(
        "{variant_struct}namespace forms {{\ntemplate <{params}> struct {name} {{\n\
         {variant}\
         \x20   static constexpr int kThreadsPerCta = ({threads});\n\
         \x20   static constexpr int kSmemBytes = ({smem});\n\
         {cluster}{tile}\
         \x20   static __device__ __forceinline__ void run(const {p}& p) {{ {entry}(p); }}\n\
         }};\n}}  // namespace forms\n",
        variant_struct = variant_struct(form),
        params = wrapper_params(form),
        name = form.name,
        threads = form.threads,
        smem = form.smem,
        p = form.params,
        entry = form.entry,
    )
}

fn module_source(members: &[&Instance]) -> Result<String, String> {
    let mut code = String::from("// Generated by build.rs from kernels/kernels.toml.\n");
    let mut forms: Vec<&Form> = Vec::new();
    for inst in members {
        if !forms.iter().any(|f| f.name == inst.form.name) {
            forms.push(inst.form);
        }
    }
    let mut headers: Vec<&str> = forms.iter().map(|f| f.header.as_str()).collect();
    headers.dedup();
    for h in headers {
        writeln!(code, "#include \"{h}\"").unwrap();
    }
    for form in &forms {
        code.push_str(&wrapper_struct(form));
    }
    for inst in members {
        let wrapper = inst.wrapper()?;
        let bounds = match inst.form.min_ctas_per_sm.expr() {
            None => format!("{wrapper}::kThreadsPerCta"),
            Some(_) => format!("{wrapper}::kThreadsPerCta, {wrapper}::kMinCtasPerSm"),
        };
        writeln!(
            code,
            "extern \"C\" __global__ void __launch_bounds__({bounds}) {}(const __grid_constant__ {} p) {{ {wrapper}::run(p); }}",
            inst.symbol(),
            inst.form.params,
        )
        .unwrap();
    }
    Ok(code)
}

/// A launch parameter block as its header declares it: fields in order, with their C types.
struct Layout {
    name: String,
    fields: Vec<(String, String)>,
}

fn table_source_code(spec: &Spec, instances: &[Instance]) -> Result<(String, Vec<Layout>), String> {
    let mut code =
        String::from("// Generated by build.rs from kernels/kernels.toml.\n#include <cstddef>\n");
    // The forms this build compiles: an architecture-specific form's header refuses other targets.
    let built: Vec<&Form> = spec
        .form
        .iter()
        .filter(|f| instances.iter().any(|i| std::ptr::eq(i.form, *f)))
        .collect();
    let mut headers: Vec<&str> = built.iter().map(|f| f.header.as_str()).collect();
    headers.extend(spec.params.iter().map(|p| p.header.as_str()));
    headers.extend(spec.constants.iter().map(|c| c.header.as_str()));
    headers.sort();
    headers.dedup();
    for h in headers {
        writeln!(code, "#include \"{h}\"").unwrap();
    }
    for form in &built {
        code.push_str(&wrapper_struct(form));
    }
    let global = |code: &mut String, name: &str, expr: &str| {
        writeln!(
            code,
            "extern \"C\" __device__ const long long {name} = ({expr});"
        )
        .unwrap();
    };
    for inst in instances {
        let w = inst.wrapper()?;
        let sym = inst.symbol();
        global(
            &mut code,
            &format!("{sym}__threads"),
            &format!("{w}::kThreadsPerCta"),
        );
        global(
            &mut code,
            &format!("{sym}__smem"),
            &format!("{w}::kSmemBytes"),
        );
        if inst.form.cluster_smem.is_some() {
            global(
                &mut code,
                &format!("{sym}__cluster_smem"),
                &format!("{w}::kClusterSmemBytes"),
            );
        }
        if inst.form.tile_rows.is_some() {
            global(
                &mut code,
                &format!("{sym}__tile_rows"),
                &format!("{w}::kTileRows"),
            );
        }
        if inst.form.tile_keys.is_some() {
            global(
                &mut code,
                &format!("{sym}__tile_keys"),
                &format!("{w}::kTileKeys"),
            );
        }
    }
    let mut layouts = Vec::new();
    for p in &spec.params {
        let layout = parse_struct(&read_header(&p.header)?, &p.name)
            .map_err(|e| format!("{KERNEL_DIR}/{}: {e}", p.header))?;
        global(
            &mut code,
            &format!("{}__size", p.name),
            &format!("sizeof({})", p.name),
        );
        for (field, _) in &layout.fields {
            global(
                &mut code,
                &format!("{}__offset__{field}", p.name),
                &format!("offsetof({}, {field})", p.name),
            );
        }
        layouts.push(layout);
    }
    for c in &spec.constants {
        global(&mut code, &format!("const__{}", c.rust), &c.name);
    }
    Ok((code, layouts))
}

fn read_header(header: &str) -> Result<String, String> {
    let path = Path::new(KERNEL_DIR).join(header);
    fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))
}

/// `text` without `//` and `/* */` comments.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |i| &after[i..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |i| &after[i + 2..]);
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The body between `{` and `}` of the declaration that starts with `opening`.
fn body_of<'a>(text: &'a str, opening: &str) -> Result<&'a str, String> {
    let start = text
        .find(opening)
        .ok_or_else(|| format!("no `{opening}` found"))?;
    let open = start + text[start..].find('{').ok_or("no opening brace")?;
    let close = open + text[open..].find('}').ok_or("no closing brace")?;
    Ok(&text[open + 1..close])
}

fn parse_struct(header: &str, name: &str) -> Result<Layout, String> {
    let text = strip_comments(header);
    let body = body_of(&text, &format!("struct {name} {{"))?;
    let mut fields = Vec::new();
    for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        let mut parts = decl.split(',').map(str::trim);
        let first = parts.next().unwrap_or_default();
        let split = first
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .ok_or_else(|| format!("cannot read the declaration `{decl}` in struct {name}"))?;
        let (ty, field) = (first[..=split].trim(), first[split + 1..].trim());
        fields.push((field.to_string(), ty.to_string()));
        for more in parts {
            if more.contains('*') || !more.chars().all(|c| c.is_alphanumeric() || c == '_') {
                return Err(format!(
                    "struct {name}: declare `{more}` on a line of its own (one pointer per line)"
                ));
            }
            fields.push((more.to_string(), ty.to_string()));
        }
    }
    Ok(Layout {
        name: name.to_string(),
        fields,
    })
}

/// The Rust type that has a C type's size and alignment in a parameter block: another block
/// (one of `blocks`) nested in it has its own twin.
fn rust_type<'a>(cxx: &'a str, blocks: &[Layout]) -> Result<&'a str, String> {
    if cxx.contains('*') {
        return Ok("u64");
    }
    if blocks.iter().any(|b| b.name == cxx) {
        return Ok(cxx);
    }
    // A TMA descriptor: 128 opaque bytes, 64-byte aligned (crate::cuda::tensor_map).
    if cxx == "TensorMap" {
        return Ok("crate::cuda::tensor_map::TensorMap");
    }
    Ok(match cxx {
        "int" => "i32",
        "unsigned" | "unsigned int" | "uint32_t" => "u32",
        "long long" => "i64",
        "float" => "f32",
        other => {
            return Err(format!(
                "no Rust twin for the C type `{other}`; add it to build.rs"
            ))
        }
    })
}

fn parse_enum(header: &str, spec: &EnumSpec) -> Result<Vec<(String, i64)>, String> {
    let text = strip_comments(header);
    let body = body_of(&text, &format!("enum {} ", spec.name))?;
    let mut variants = Vec::new();
    for item in body.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| format!("enum {}: give `{item}` an explicit value", spec.name))?;
        let name = name.trim();
        let rust = name.strip_prefix(spec.prefix.as_str()).ok_or_else(|| {
            format!(
                "enum {}: `{name}` does not start with `{}`",
                spec.name, spec.prefix
            )
        })?;
        let value: i64 = value
            .trim()
            .parse()
            .map_err(|_| format!("enum {}: `{item}` needs an integer value", spec.name))?;
        variants.push((rust.to_string(), value));
    }
    Ok(variants)
}

fn rust_table(
    spec: &Spec,
    instances: &[Instance],
    modules: &BTreeMap<String, Vec<&Instance>>,
    layouts: &[Layout],
    values: &BTreeMap<String, i64>,
) -> Result<String, String> {
    let value = |name: &str| -> Result<i64, String> {
        values
            .get(name)
            .copied()
            .ok_or_else(|| format!("the compiler did not evaluate `{name}`"))
    };
    let mut code = String::from("// Generated by build.rs from kernels/kernels.toml.\n\n");

    code.push_str(
        "/// The kernel forms of `kernels/kernels.toml`.\n\
         #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]\n\
         #[allow(dead_code)]\n\
         pub(crate) enum KernelForm {\n",
    );
    for form in &spec.form {
        writeln!(code, "    {},", form.name).unwrap();
    }
    code.push_str("}\n\n");

    for module in modules.keys() {
        writeln!(
            code,
            "const IMAGE_{}: &[u8] = include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{module}.fatbin\"));",
            module.to_uppercase()
        )
        .unwrap();
    }
    code.push_str(
        "\n/// Every compiled instance.\npub(crate) static KERNELS: &[KernelSpec] = &[\n",
    );
    for inst in instances {
        let sym = inst.symbol();
        let optional = |present: bool, what: &str| -> Result<i64, String> {
            if present {
                value(&format!("{sym}__{what}"))
            } else {
                Ok(0)
            }
        };
        let cluster = optional(inst.form.cluster_smem.is_some(), "cluster_smem")?;
        let tile_rows = optional(inst.form.tile_rows.is_some(), "tile_rows")?;
        let tile_keys = optional(inst.form.tile_keys.is_some(), "tile_keys")?;
        writeln!(
            code,
            "    KernelSpec {{ form: KernelForm::{form}, dtype: candle_core::DType::{dtype}, \
             kv_dtype: candle_core::DType::{kv}, head_dim: {d}, group: {g}, symbol: \"{sym}\", \
             module: \"{module}\", image: IMAGE_{upper}, threads: {threads}, smem_bytes: {smem}, \
             cluster_smem_bytes: {cluster}, tile_rows: {tile_rows}, tile_keys: {tile_keys} }},",
            form = inst.form.name,
            dtype = inst.dtype.to_uppercase(),
            kv = inst.kv_dtype_variant(),
            d = inst.head_dim.unwrap_or(0),
            g = inst.group.unwrap_or(0),
            module = inst.module(),
            upper = inst.module().to_uppercase(),
            threads = value(&format!("{sym}__threads"))?,
            smem = value(&format!("{sym}__smem"))?,
        )
        .unwrap();
    }
    code.push_str("];\n\n");

    for layout in layouts {
        writeln!(
            code,
            "/// `{}` of the kernels, field for field.\n\
             #[repr(C)]\n#[derive(Debug, Clone, Copy)]\n#[allow(dead_code)]\n\
             pub(crate) struct {} {{",
            layout.name, layout.name
        )
        .unwrap();
        for (field, ty) in &layout.fields {
            writeln!(code, "    pub {field}: {},", rust_type(ty, layouts)?).unwrap();
        }
        code.push_str("}\n\n");
        writeln!(
            code,
            "// SAFETY: plain-old-data with the C layout the kernels expect (checked below).\n\
             unsafe impl cudarc::driver::DeviceRepr for {} {{}}",
            layout.name
        )
        .unwrap();
        writeln!(
            code,
            "const _: () = assert!(std::mem::size_of::<{}>() == {});",
            layout.name,
            value(&format!("{}__size", layout.name))?
        )
        .unwrap();
        for (field, _) in &layout.fields {
            writeln!(
                code,
                "const _: () = assert!(std::mem::offset_of!({}, {field}) == {});",
                layout.name,
                value(&format!("{}__offset__{field}", layout.name))?
            )
            .unwrap();
        }
        code.push('\n');
    }

    for e in &spec.enums {
        let variants = parse_enum(&read_header(&e.header)?, e)
            .map_err(|err| format!("{KERNEL_DIR}/{}: {err}", e.header))?;
        writeln!(
            code,
            "/// `{}` of the kernels.\n\
             #[repr(i32)]\n#[derive(Debug, Clone, Copy, PartialEq, Eq)]\n#[allow(dead_code)]\n\
             pub(crate) enum {} {{",
            e.name, e.name
        )
        .unwrap();
        for (name, v) in variants {
            writeln!(code, "    {name} = {v},").unwrap();
        }
        code.push_str("}\n\n");
    }

    for c in &spec.constants {
        writeln!(
            code,
            "/// `{}` of the kernels.\npub(crate) const {}: usize = {};",
            c.name,
            c.rust,
            value(&format!("const__{}", c.rust))?
        )
        .unwrap();
    }
    Ok(code)
}

/// The `.global` constants of a PTX file: `name = value` for each integer global.
fn ptx_globals(ptx: &Path) -> Result<BTreeMap<String, i64>, String> {
    let text = fs::read_to_string(ptx).map_err(|e| format!("reading {}: {e}", ptx.display()))?;
    let mut values = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if !line.starts_with(".global") && !line.starts_with(".visible .global") {
            continue;
        }
        // A global without an initializer is zero.
        let line = line.trim_end_matches(';');
        let (lhs, rhs) = line.split_once('=').unwrap_or((line, "0"));
        let Some(name) = lhs.split_whitespace().last() else {
            continue;
        };
        if let Ok(v) = rhs.trim().parse::<i64>() {
            values.insert(name.to_string(), v);
        }
    }
    Ok(values)
}

/// What nvcc makes of a source.
#[derive(Clone, Copy)]
enum OutputKind {
    /// PTX text, for the table build.rs reads.
    Ptx,
    /// A module the crate embeds: the PTX, and with `machine_code` the target's machine code.
    Fatbin { machine_code: bool },
}

/// One nvcc run: `source` compiled for `arch` (such as `90` or `90a`) into `output`.
struct NvccJob {
    source: PathBuf,
    output: PathBuf,
    arch: String,
    output_kind: OutputKind,
}

impl NvccJob {
    fn spawn(&self, nvcc: &Path) -> Result<Child, String> {
        let arch = &self.arch;
        let mut command = Command::new(nvcc);
        match self.output_kind {
            OutputKind::Ptx => command
                .arg("--ptx")
                .arg(format!("--gpu-architecture=compute_{arch}")),
            // The driver loads the machine code where it matches the GPU, else compiles the PTX.
            OutputKind::Fatbin { machine_code } => command.arg("--fatbin").arg(if machine_code {
                format!("--generate-code=arch=compute_{arch},code=[sm_{arch},compute_{arch}]")
            } else {
                format!("--generate-code=arch=compute_{arch},code=compute_{arch}")
            }),
        };
        command
            .args(["-O3", "-std=c++17", "-Werror", "all-warnings"])
            .arg("-I")
            .arg(KERNEL_DIR)
            .arg("-o")
            .arg(&self.output)
            .arg(&self.source);
        // Into a file, not a pipe: a compiler that writes more than a pipe holds would wait for
        // a reader while compile_all waits for it to exit.
        let log = fs::File::create(self.log())
            .map_err(|e| format!("creating {}: {e}", self.log().display()))?;
        let log_err = log
            .try_clone()
            .map_err(|e| format!("opening {}: {e}", self.log().display()))?;
        command
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|e| format!("running {}: {e}", nvcc.display()))
    }

    /// Where the compiler's messages go.
    fn log(&self) -> PathBuf {
        self.output.with_extension("log")
    }
}

/// Runs nvcc on the jobs, at most `NUM_JOBS` at a time (cargo's `-j`, the machine's cores by
/// default), the largest sources first so that the last to finish is a small one. All at once
/// would hold every compiler's memory together: several GB on a small machine.
fn compile_all(nvcc: &Path, jobs: &[NvccJob]) -> Result<(), String> {
    let parallel = env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
        .max(1);
    let size = |job: &NvccJob| fs::metadata(&job.source).map_or(0, |m| m.len());
    let mut queue: Vec<&NvccJob> = jobs.iter().collect();
    queue.sort_by_key(|job| std::cmp::Reverse(size(job)));
    let mut queue = queue.into_iter();
    let mut running: Vec<(&NvccJob, Child)> = Vec::new();
    let mut failures = String::new();
    loop {
        while running.len() < parallel {
            let Some(job) = queue.next() else { break };
            running.push((job, job.spawn(nvcc)?));
        }
        if running.is_empty() {
            break;
        }
        // Reap whichever finishes first; poll, as std has no wait-for-any.
        let done = loop {
            let finished = running
                .iter_mut()
                .position(|(_, child)| matches!(child.try_wait(), Ok(Some(_)) | Err(_)));
            match finished {
                Some(i) => break i,
                None => std::thread::sleep(std::time::Duration::from_millis(50)),
            }
        };
        let (job, mut child) = running.swap_remove(done);
        let status = child.wait().map_err(|e| format!("waiting for nvcc: {e}"))?;
        if !status.success() {
            write!(
                failures,
                "nvcc failed on {}:\n{}",
                job.source.display(),
                fs::read_to_string(job.log()).unwrap_or_default()
            )
            .unwrap();
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures)
    }
}

fn cxx_type(dtype: &str) -> Result<&'static str, String> {
    Ok(match dtype {
        "f32" => "float",
        "f16" => "__half",
        "bf16" => "__nv_bfloat16",
        "f8e4m3" => "__nv_fp8_e4m3",
        other => {
            return Err(format!(
                "{SPEC}: unknown dtype {other:?}; use f32, f16, bf16 or f8e4m3"
            ))
        }
    })
}

/// The oldest target that converts a K/V storage type in hardware: e4m3 pairs widen to f16 pairs
/// in one instruction from sm_89 on.
fn kv_min_compute_cap(kv_dtype: &str) -> u32 {
    match kv_dtype {
        "f8e4m3" => 89,
        _ => MIN_COMPUTE_CAP,
    }
}

/// `TensorCoreLastCta` → `tensor_core_last_cta`.
fn snake(name: &str) -> String {
    let mut s = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            s.push('_');
        }
        s.push(c.to_ascii_lowercase());
    }
    s
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    // Rewriting an unchanged file would make cargo rebuild what includes it.
    if fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// `NVCC`, then `bin/nvcc` under `CUDA_ROOT`, `CUDA_HOME` or `CUDA_PATH`, then `nvcc` on PATH.
fn find_nvcc() -> Result<PathBuf, String> {
    if let Some(nvcc) = env::var_os("NVCC") {
        return Ok(PathBuf::from(nvcc));
    }
    for var in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env::var_os(var) {
            let candidate = PathBuf::from(root).join("bin").join("nvcc");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let candidate = dir.join("nvcc");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(
        "nvcc not found; set NVCC or CUDA_ROOT, or run scripts/cuda-toolkit.sh and export \
         what it prints"
            .into(),
    )
}

/// `CUDA_COMPUTE_CAP` (e.g. 80 or 90), else the first GPU that nvidia-smi reports.
fn compute_cap() -> Result<String, String> {
    if let Ok(cap) = env::var("CUDA_COMPUTE_CAP") {
        let cap = cap.trim().replace('.', "");
        if cap.is_empty() || !cap.chars().all(|c| c.is_ascii_digit()) {
            return Err(format!(
                "CUDA_COMPUTE_CAP must be a number such as 80 or 90, got {cap:?}"
            ));
        }
        return Ok(cap);
    }
    let smi = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output();
    if let Ok(out) = smi {
        if out.status.success() {
            let text = String::from_utf8_lossy(&out.stdout);
            if let Some(first) = text.lines().next() {
                let cap = first.trim().replace('.', "");
                if !cap.is_empty() && cap.chars().all(|c| c.is_ascii_digit()) {
                    return Ok(cap);
                }
            }
        }
    }
    Err(
        "no GPU found by nvidia-smi to pick the target; set CUDA_COMPUTE_CAP (80 for A100, \
         90 for H100/H200)"
            .into(),
    )
}
