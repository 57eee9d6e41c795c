// A probe, not part of the build: the products of one generated token of the GPT of
// `examples/generate.rs` (4 blocks of 128x384, 128x128, 128x512 and 512x128, and the head,
// 128x65 padded to 80: 796,672 weights) as one-row products, with the weights in f32 and
// in bf16 (widened to f32 in registers, the sums in f32), each repeated alone so that what
// fits in L2 stays there; and the time to read the f32 weights once. The least time of
// each over many passes, as JSON. AVX-512; see benches/README.md ("Generation").
//
//   cc -O2 -mavx512f -mavx512bw -mfma benches/probes/weights_gemv.c -o target/weights_gemv
//   target/weights_gemv 300
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
typedef struct {int k,n;} Shape;
static Shape shapes[17];
static int nsh=0;
// y[n] = x[k] W[k][n], n a multiple of 16, columns in tiles of 256
static void gemv_f32(const float*x,const float*W,float*y,int k,int n){
  for(int c=0;c<n;c+=256){int w=n-c<256?n-c:256; int t=w/16; __m512 acc[16];
    for(int j=0;j<t;j++)acc[j]=_mm512_setzero_ps();
    for(int i=0;i<k;i++){__m512 b=_mm512_set1_ps(x[i]);const float*r=W+(size_t)i*n+c;
      for(int j=0;j<t;j++)acc[j]=_mm512_fmadd_ps(b,_mm512_loadu_ps(r+16*j),acc[j]);}
    for(int j=0;j<t;j++)_mm512_storeu_ps(y+c+16*j,acc[j]);}
}
static void gemv_bf16(const float*x,const uint16_t*W,float*y,int k,int n){
  for(int c=0;c<n;c+=256){int w=n-c<256?n-c:256; int t=w/16; __m512 acc[16];
    for(int j=0;j<t;j++)acc[j]=_mm512_setzero_ps();
    for(int i=0;i<k;i++){__m512 b=_mm512_set1_ps(x[i]);const uint16_t*r=W+(size_t)i*n+c;
      for(int j=0;j<t;j++){__m512i h=_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r+16*j)));
        acc[j]=_mm512_fmadd_ps(b,_mm512_castsi512_ps(_mm512_slli_epi32(h,16)),acc[j]);}}
    for(int j=0;j<t;j++)_mm512_storeu_ps(y+c+16*j,acc[j]);}
}
int main(int argc,char**argv){
  int passes=argc>1?atoi(argv[1]):300;
  for(int l=0;l<4;l++){shapes[nsh++]=(Shape){128,384};shapes[nsh++]=(Shape){128,128};shapes[nsh++]=(Shape){128,512};shapes[nsh++]=(Shape){512,128};}
  shapes[nsh++]=(Shape){128,80};
  size_t total=0; for(int s=0;s<nsh;s++) total+=(size_t)shapes[s].k*shapes[s].n;
  float*W=aligned_alloc(64,total*4); uint16_t*H=aligned_alloc(64,total*2);
  for(size_t i=0;i<total;i++){W[i]=((i*2654435761u)%1000)/1000.0f-0.5f; uint32_t b; memcpy(&b,&W[i],4); H[i]=b>>16;}
  float x[512],y[512]; for(int i=0;i<512;i++)x[i]=(i%7)/7.0f;
  double best_f=1e9,best_h=1e9,best_r=1e9; float sink=0;
  for(int p=0;p<passes;p++){ double t0=now(); size_t off=0;
    for(int s=0;s<nsh;s++){gemv_f32(x,W+off,y,shapes[s].k,shapes[s].n);off+=(size_t)shapes[s].k*shapes[s].n;x[0]=y[0]*1e-9f;}
    double t=now()-t0; if(t<best_f)best_f=t; }
  for(int p=0;p<passes;p++){ double t0=now(); size_t off=0;
    for(int s=0;s<nsh;s++){gemv_bf16(x,H+off,y,shapes[s].k,shapes[s].n);off+=(size_t)shapes[s].k*shapes[s].n;x[0]=y[0]*1e-9f;}
    double t=now()-t0; if(t<best_h)best_h=t; }
  for(int p=0;p<passes;p++){ double t2=now();
    __m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
    for(size_t i=0;i<total;i+=64){a0=_mm512_add_ps(a0,_mm512_load_ps(W+i));a1=_mm512_add_ps(a1,_mm512_load_ps(W+i+16));a2=_mm512_add_ps(a2,_mm512_load_ps(W+i+32));a3=_mm512_add_ps(a3,_mm512_load_ps(W+i+48));}
    double t3=now(); sink+=_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));
    if(t3-t2<best_r)best_r=t3-t2; }
  printf("{\"weights\": %zu, \"f32_bytes\": %zu, \"bf16_bytes\": %zu, \"gemv_f32_us\": %.1f, \"gemv_bf16_us\": %.1f, \"read_f32_us\": %.1f, \"sink\": %g}\n",
    total,total*4,total*2,best_f,best_h,best_r,(double)sink+y[1]);
}
